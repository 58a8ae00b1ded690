"""``asyncrl plan``: the real trainer — staleness gate, buffer, rollout loop, train loop,
weight-sync strategy — on a virtual clock (``virtual_clock.py``) against cost-model
engines (``engine.py``) and learners behind the runtime's handles (``simulated.py``), with
costs fitted to a real run or read from a cluster table (``costs.py``); ``planner.py`` runs a configuration, its sync
baseline and a sweep over η and the rollout/learner split."""
