"""What a rank measures and records: the step meter, NVML sampling, results.csv, and the rank and run reports."""
