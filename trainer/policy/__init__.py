from trainer import heap

heap.pause_for_actor("trainer.policy.worker.PolicyWorker")  # PolicyWorker.__init__ settles
