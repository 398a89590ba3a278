"""`overdrive train`: the training loop, objectives, data order, parallel strategies, pipeline, launch and checkpoints."""
