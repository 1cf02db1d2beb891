"""Executors: what runs the model runner, in this process or over worker processes (one per
rank). Above the runner and the models, imported by the engine core; the parallel state and
collectives they set up live below the models, in :mod:`agentx.engine.parallel`."""
