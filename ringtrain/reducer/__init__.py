"""What every binding shares above the core API: the gradient Reducer, the sharded-optimizer plan, Horovod's gradient rules, compression, the model check and the wrapper classes."""
