"""Agentic rollouts: episodes of several turns in which the model generates, and a tool, an environment or an agent
loop answers with an observation that is appended as tokens (token in, token out: the model's tokens are never
re-tokenized).

- `protocol.py`: what users write against: `Environment` (reset/step), `AgentLoop` (turn by turn), `Reply`.
- `tools.py`: tools (an OpenAI function schema and a callable), calls in worker processes with a time limit.
- `parsers.py`: the tool-call parsers of each model family (`data.tool_parser`), shared by the tool loop and the
  OpenAI gateway.
- `loops.py`: the built-in agent loop (tools, then the environment) and the registry (`data.env`, `data.tools`,
  `data.agent`: a built-in name or `package.module:attr`).
- `render.py`: observations as tokens, rendered with the model's chat template (image observations expanded by a
  vision-language model's processor).
- `episode.py`: one episode's state machine, which the rollout engines drive; single-turn rollouts are its one-turn
  case.
- `guess_number.py`: the built-in environment of `data=guess_number`.
- `grid_walk.py`: `data.env=grid_walk`, a small visual game whose observations are images (vision-language models).

Layer 3 of 0-9 (docs/design.md), beside `relax/data` and `relax/rewards`: imports Relax packages of lower layers and
of its own layer only.
"""
