"""The shared core every verb uses: devices and thread policy, errors, the Workload, the Timer and Measurement, report helpers."""
