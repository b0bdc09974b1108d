"""Planning: pure functions from (config, this node's facts, dataset) to a LaunchPlan and its problems. No torch.

plan.py decides, checks.py words the problems, lr.py holds the batch-size and warmup rules, environment.py the
ranks' environment variables, decisions.py what the ranks would otherwise derive again, settings.py the typed
settings the ranks read, describe.py the plan as printed.
"""
