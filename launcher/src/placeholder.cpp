namespace ddprun { void placeholder_launcher() {} }
