"""The cluster manager: a deployment's desired state, the processes that carry it out, and its scaling."""
