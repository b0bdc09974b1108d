"""Facts about what a run trains on: the dataset, the network, the synthetic data, and the Ultralytics release,
read from files only (nothing here imports Ultralytics or torch)."""
