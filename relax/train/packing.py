"""A micro-batch as the model takes it: its padded rows trimmed of the columns that are padding in every row
(`trimmed_sequences`), or packed (`train.pack_sequences`): its rows as one row without padding (`pack`).

Packed, each row's real prompt tokens and its response tokens follow the previous row's, with position ids that
restart at 0: Hugging Face's causal models then attend only within each sequence (their mask builder reads the restarts
from the position ids when no attention mask is given, `transformers.masking_utils.find_packed_sequence_indices`;
flash-attention's variable-length kernels, where installed, take the same input). The model computes exactly the
micro-batch's tokens, none of its padding; the values equal the padded computation's up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.batch import Samples


@dataclass(frozen=True)
class Packed:
    """A micro-batch packed into one row of `L` tokens."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L], from 0 in each sequence
    before: torch.Tensor  # [M]: the position of the state before each response token, row by row
    targets: torch.Tensor  # [M]: those response tokens
    valid: torch.Tensor  # [N, T] bool: where the M tokens go back in the micro-batch's response columns
    response_len: int  # T: the micro-batch's response columns in use (its longest response)

    def to(self, device: torch.device) -> Packed:
        return Packed(self.input_ids.to(device), self.position_ids.to(device), self.before.to(device),
                      self.targets.to(device), self.valid.to(device), self.response_len)

    def place(self, values: torch.Tensor) -> torch.Tensor:
        """[M] values back into [N, T] response positions (0 elsewhere)."""
        return values.new_zeros(self.valid.shape).masked_scatter(self.valid, values)


def trimmed_sequences(samples: Samples) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(input_ids, attention_mask, P', T') without the columns that are padding in every row.

    Left prompt columns and right response columns that no row uses only cost compute; masked keys get
    exactly zero attention weight, so dropping them changes results only by float rounding.
    """
    P = samples.prompt_ids.shape[1]
    used = samples.prompt_mask.bool().any(0).nonzero()
    first = min(int(used[0]) if len(used) else P - 1, P - 1)  # keep >= 1 prompt column
    present = samples.present()  # observations of an episode are attended to, though not trained
    used_r = present.bool().any(0).nonzero()
    T = int(used_r[-1]) + 1 if len(used_r) else 1
    ids = torch.cat([samples.prompt_ids[:, first:], samples.response_ids[:, :T]], dim=1)
    mask = torch.cat([samples.prompt_mask[:, first:], present[:, :T]], dim=1)
    return ids, mask, P - first, T


def response_reach(samples: Samples) -> torch.Tensor:
    """[N]: response columns each row uses (last present position + 1; its response tokens and observations)."""
    present = samples.present() != 0
    positions = torch.arange(1, present.shape[1] + 1)
    return (present * positions).amax(-1) if present.shape[1] else torch.zeros(len(samples), dtype=torch.long)


def pack(samples: Samples) -> Packed:
    """`samples` as one packed row (prompts left-padded, responses right-padded: each row's present response
    positions must be a prefix of its columns)."""
    present = samples.present() != 0
    reach = response_reach(samples)
    T = max(1, int(reach.max())) if len(reach) else 1
    ids, positions, before, targets = [], [], [], []
    offset = 0
    for i in range(len(samples)):
        r = int(reach[i])
        if not bool(present[i, :r].all()):
            raise ValueError(f"pack: row {i}'s response has padding between its tokens; packing needs them first")
        prompt = samples.prompt_ids[i][samples.prompt_mask[i] != 0]
        response = samples.response_ids[i, :r]
        ids += [prompt, response]
        n = len(prompt) + r
        positions.append(torch.arange(n))
        before.append(offset + len(prompt) - 1 + torch.arange(r))
        targets.append(response)
        offset += n
    return Packed(input_ids=torch.cat(ids).unsqueeze(0), position_ids=torch.cat(positions).unsqueeze(0),
                  before=torch.cat(before), targets=torch.cat(targets), valid=present[:, :T].clone(),
                  response_len=T)


def packed_tokens(samples: Samples) -> torch.Tensor:
    """[N]: tokens each row adds to a packed micro-batch (real prompt tokens + response columns it uses)."""
    return samples.prompt_mask.sum(-1) + response_reach(samples)
