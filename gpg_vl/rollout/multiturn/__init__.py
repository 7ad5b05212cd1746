"""Multi-turn rollouts (rollout.max_turns > 1): `trajectory` (a trajectory's turns, tool calls and token types; the
multi-turn settings), `tools` (the tool registry, zoom_in), `decoding` (the HF engine's turn-by-turn decoding)."""
