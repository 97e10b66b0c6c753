"""Starting processes and forming worlds: `ringtrain-run`, the elastic driver and its host discovery, and the Spark and Ray launchers. Imports the core API, never a binding."""
