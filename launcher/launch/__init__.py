"""Starting the ranks: the torchrun command, the console, the Ultralytics home, and one environment per kind of
cluster (environments/). Imports the plan and the run folder, never the rank side."""
