"""The checkpoint engine: the manager, each slot's controller and memory, the captures and the cost probes."""
