"""The engine: requests, the scheduler (continuous batching, priorities, joins), and the step
loop that runs the model over the scheduled batch."""
