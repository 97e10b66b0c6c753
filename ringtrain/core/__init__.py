"""The core API on numpy and cupy arrays: init() and the process-wide state, the collectives, process sets. `import ringtrain` re-exports it."""
