"""pipeplan's pure domain: the contract, the simulator and validator, bounds, heuristics, solvers.

Nothing in this package performs I/O; the CLI, service and worker wrap it.
"""
