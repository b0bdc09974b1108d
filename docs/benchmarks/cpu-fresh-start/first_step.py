"""first_step.py SUMMARY_JSON NAME: one line, the time from the command to the first step and the timeline's parts."""
import json
import sys

t = json.load(open(sys.argv[1]))["timeline"]
s, setup = t["stamps"], {p["part"]: p["end"] for p in t["setup"]}
parts = ["launcher_start", "torchrun_start", "rank_start", "imports_done", "components_built", "first_step"]
print(f"{sys.argv[2]:10s} to the first step {s['first_step'] - s['launcher_start']:5.2f} s:",
      " ".join(f"{b} {s[b] - s[a]:.2f}" for a, b in zip(parts, parts[1:])),
      f"(of which the optimizer's build, Dynamo's import: {setup['optimizer_ema_loss'] - setup['val_data']:.2f})")
