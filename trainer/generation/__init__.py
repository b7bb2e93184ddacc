from trainer import heap

heap.pause_for_actor("trainer.generation.worker.GenerationWorker")  # GenerationWorker.__init__ settles
