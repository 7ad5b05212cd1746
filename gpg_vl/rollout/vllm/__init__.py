"""The vLLM engines: `colocated` (vLLM in the training processes, weights loaded in place after each step),
`server` (separate `vllm serve` processes over HTTP) with its `client` (the servers, their deadlines, the data-parallel
split) and `weight_transfer` (the weights to the servers: HTTP, or NCCL on a shared group), and `common` (what both
engines share: request settings, the banned-token bias, the rollout from vLLM's outputs)."""
