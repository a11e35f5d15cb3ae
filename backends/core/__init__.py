"""What every backend shares, once: typed parameters, the adapter base (errors, devices, logs), request inputs,
custom metrics, device and precision names, and the runtimes that open exported engines."""
