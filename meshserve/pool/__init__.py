"""The caching cluster: a pool of memory servers (DRAM + SSD tiers) shared by every TE, its controller and SDK."""
