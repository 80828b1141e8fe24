namespace ddprun { void placeholder_worker_env() {} }
