"""KV connectors, worker halves: one rank's end of remote KV (`pool`: the memory pool's context cache;
`pd`: prefill -> decode transfer). The scheduler halves are in `meshserve.core.kv_connector`."""
