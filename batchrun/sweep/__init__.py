"""batchrun sweep: a dataset x a grid of generation settings -> generations -> scores -> tables."""
