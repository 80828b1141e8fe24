namespace ddprun { void placeholder_agent() {} }
