"""Where the parts run. ``local``: one process, the engine and the learner on their own
threads (``RolloutWorker`` + ``LocalLearner``). ``ray``: the same two objects as Ray
actors (``ray_runtime``). The orchestrator talks to either through the same calls."""
