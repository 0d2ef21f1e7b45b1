"""The benchmark: prompt sets, the measurement loop, HF baselines, the analytic bound and the reports."""
