"""The orchestrator's ends of the weight paths, one module per mechanism (contract.weight_paths names them;
the interface is orchestrate.serving.weights.Transport)."""
