"""Finding the targets of prompt updates and applying the updates, with vLLM's rules.

The rules are those of vLLM 0.9's `find_token_matches` / `find_text_matches` / `_apply_matches`:

- Each update's target is matched left to right without overlap. An empty token target never
  matches; an empty text target matches at the start (so it takes effect through the text path).
- The matches of every modality are taken in prompt order, and each modality hands out its items
  in item order: a replacement of a non-empty match takes one item; an insertion, or a replacement
  of an empty match (a `PromptIndexTargets` position), takes every item not placed yet, all there.
- Matches that overlap are an error.

`apply_prompt_updates` matches token ids first; when some item finds no target there (the
target's text sits inside larger tokens), it decodes the prompt, works on the text and encodes it
again. On top of vLLM it refuses what vLLM would silently get wrong (docs/vllm-compatibility.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .inputs import PlaceholderRange
from .prompt_updates import (
    BoundPromptSequence,
    PromptIndex,
    PromptSeq,
    PromptTarget,
    PromptUpdate,
    PromptUpdateDetails,
    TokenCodec,
    UpdateMode,
)


@dataclass
class ResolvedUpdate:
    """One update bound to one item: where it goes and what it puts there."""

    modality: str
    item_idx: int
    mode: UpdateMode
    target: PromptTarget
    content: BoundPromptSequence
    details: PromptUpdateDetails

    def placeholder(self, offset: int) -> PlaceholderRange:
        is_embed = self.details.is_embed(self.content) if self.details.is_embed is not None else None
        return PlaceholderRange(offset=offset, length=len(self.content.token_ids), is_embed=is_embed)


# modality (in the order the model declared them) -> its updates, in order -> one per item
ResolvedUpdates = Mapping[str, Sequence[Sequence[ResolvedUpdate]]]
Placeholders = dict[str, list[PlaceholderRange]]


def resolve_updates(
    updates: Sequence[PromptUpdate], item_counts: Mapping[str, int], codec: TokenCodec
) -> dict[str, list[list[ResolvedUpdate]]]:
    resolved: dict[str, list[list[ResolvedUpdate]]] = {}
    for update in updates:
        count = item_counts.get(update.modality, 0)
        items = []
        for i in range(count):
            details = update.resolve(i)
            content = BoundPromptSequence(codec, details.full)
            items.append(ResolvedUpdate(update.modality, i, update.mode, update.target, content, details))
        if count:
            resolved.setdefault(update.modality, []).append(items)
    for modality, count in item_counts.items():
        if count and modality not in resolved:
            raise ValueError(f"The model's processor declares no prompt update for {modality} items.")
    return resolved


# ---- matching ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetMatch:
    """`prompt[start:end]` matches the target of update `update_idx` of `modality`."""

    modality: str
    update_idx: int
    start: int
    end: int


def find_target_matches(prompt: PromptSeq, resolved: ResolvedUpdates, codec: TokenCodec) -> list[TargetMatch]:
    """Every match of every update's target, by modality, then update, then position."""
    return [
        TargetMatch(modality, update_idx, start, end)
        for modality, candidates in resolved.items()
        for update_idx, items in enumerate(candidates)
        for start, end in target_spans(prompt, items[0].target, codec)
    ]


def target_spans(prompt: PromptSeq, target: PromptTarget, codec: TokenCodec) -> list[tuple[int, int]]:
    """Where `target` is in `prompt` (text or token ids, matched in that form), as (start, end)."""
    if isinstance(target, PromptIndex):
        index = target.get_match_index(codec.tokenizer, prompt)
        return [] if index is None else [(index, index)]
    bound = BoundPromptSequence(codec, target)
    if isinstance(prompt, str):
        # An empty text matches at every position; only the first can receive items (it takes them all).
        return _find_all(prompt, bound.text) if bound.text else [(0, 0)]
    return _find_all(prompt, bound.token_ids)


def _find_all(seq: PromptSeq, needle: PromptSeq, start: int = 0) -> list[tuple[int, int]]:
    """Non-overlapping occurrences of a non-empty `needle` in `seq` as (start, end), left to right."""
    out: list[tuple[int, int]] = []
    n = len(needle)
    if n == 0:
        return out
    i = find_seq(seq, needle, start)
    while i >= 0:
        out.append((i, i + n))
        i = find_seq(seq, needle, i + n)
    return out


def find_seq(seq: PromptSeq, needle: PromptSeq, start: int) -> int:
    """Index of the first occurrence of `needle` in `seq` at or after `start`, or -1."""
    if isinstance(seq, str):
        return seq.find(needle, start)  # type: ignore[arg-type]
    n = len(needle)
    if n == 0:
        return start
    first, i = needle[0], start
    while i <= len(seq) - n:
        try:
            i = seq.index(first, i)  # C-speed scan for the first token
        except ValueError:
            return -1
        if seq[i : i + n] == needle:
            return i
        i += 1
    return -1


# ---- applying ----------------------------------------------------------------------------------


@dataclass
class Edit:
    """`prompt[start:end]` becomes the content of `items` (one modality), in item order."""

    start: int
    end: int
    items: list[ResolvedUpdate]


def plan_edits(matches: Sequence[TargetMatch], resolved: ResolvedUpdates) -> tuple[list[Edit], dict[str, int]]:
    """vLLM's `_apply_matches` as a plan: the edits, and how many items of each modality they place."""
    _check_overlaps(matches)
    placed = dict.fromkeys(resolved, 0)
    edits: list[Edit] = []
    # (start, end): an empty match sharing its start with another goes first, so no token is copied twice.
    for match in sorted(matches, key=lambda m: (m.start, m.end)):
        items = resolved[match.modality][match.update_idx]
        first = placed[match.modality]
        if first >= len(items):
            continue  # every item of this modality is placed; later matches stay as they are
        if items[0].mode == UpdateMode.INSERT:
            start = end = match.end
            last = len(items)
        else:
            start, end = match.start, match.end
            last = len(items) if start == end else first + 1
        edits.append(Edit(start, end, list(items[first:last])))
        placed[match.modality] = last
    return edits, placed


def _check_overlaps(matches: Sequence[TargetMatch]) -> None:
    spans = sorted(matches, key=lambda m: (m.start, m.end))
    solid = [m for m in spans if m.end > m.start]
    for prev, cur in zip(solid, solid[1:]):
        if cur.start < prev.end:
            raise _overlap_error(prev, cur)
    for empty in (m for m in spans if m.end == m.start):  # a position strictly inside a match
        for m in solid:
            if m.start < empty.start < m.end:
                raise _overlap_error(m, empty)


def _overlap_error(a: TargetMatch, b: TargetMatch) -> ValueError:
    return ValueError(
        f"The prompt update targets of {a.modality} and {b.modality} overlap at position {b.start} of the "
        "prompt; each target must be matched on its own."
    )


def splice(prompt: PromptSeq, edits: Sequence[Edit]) -> tuple[PromptSeq, list[int]]:
    """Apply edits (in position order); returns the new prompt and where each edit's content starts."""
    as_text = isinstance(prompt, str)
    pieces: list = []
    offsets, cursor, length = [], 0, 0
    for edit in edits:
        kept = prompt[cursor : edit.start]
        content = [item.content.text if as_text else item.content.token_ids for item in edit.items]
        pieces += [kept, *content]
        offsets.append(length + len(kept))
        length += len(kept) + sum(len(c) for c in content)
        cursor = edit.end
    pieces.append(prompt[cursor:])
    if as_text:
        return "".join(pieces), offsets
    return [t for piece in pieces for t in piece], offsets


def update_prompt(prompt: PromptSeq, resolved: ResolvedUpdates, codec: TokenCodec) -> tuple[PromptSeq, dict[str, int]]:
    """vLLM's `apply_token_matches` / `apply_text_matches`: the updated prompt, in the form given,
    and how many items of each modality were placed (fewer than given where targets are missing)."""
    edits, placed = plan_edits(find_target_matches(prompt, resolved, codec), resolved)
    return splice(prompt, edits)[0], placed
