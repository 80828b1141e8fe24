namespace ddprun { void placeholder_rendezvous() {} }
