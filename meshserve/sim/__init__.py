"""`meshserve simulate`: meshserve's own control plane on virtual time (docs/simulate.md)."""
