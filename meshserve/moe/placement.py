"""Where each logical expert lives: physical expert slots on EP ranks, with redundant replicas.

An EP world of N ranks with E logical experts and R redundant slots per rank has
N * (E/N + R) physical slots, rank-major: rank r holds slots [r*S, (r+1)*S) with
S = E/N + R. A layer's placement lists, per physical slot, the logical expert whose
weights it holds (-1: empty). Its replica table lists, per logical expert, the slots
holding it; tokens routed to a replicated expert rotate over those slots by their
position in the batch (xdeepserve §4.5 step 4).

A shrink plan (some ranks removed) keeps each surviving rank's S slots, so its
experts need not split evenly over the ranks left: such a shape sets
`uneven_slots_per_rank = S` and has no primary slots (every slot was planned).
An engine whose experts do not split evenly over its EP ranks has such a shape
(`engine_shape`): each rank holds ceil(E/N) + R slots, and starts with its share
of a contiguous split of the experts (the first E mod N ranks one more) in its
first slots, the rest empty, until a placement is applied.

Pure Python (the master, which has no torch, plans and ships placements).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

EMPTY = -1


@dataclass(frozen=True)
class PlacementShape:
    num_logical: int  # E
    num_ranks: int  # N (EP ranks)
    redundant_per_rank: int  # R
    uneven_slots_per_rank: int = 0  # S of a shrink plan (0: S = E/N + R)

    def __post_init__(self) -> None:
        if (self.num_logical < 1 or self.num_ranks < 1 or self.redundant_per_rank < 0
                or self.uneven_slots_per_rank < 0):
            raise ValueError(f"bad placement shape {self}")
        if self.uneven_slots_per_rank:
            if self.redundant_per_rank:
                raise ValueError("a shape with uneven_slots_per_rank has no separate redundant slots")
            if self.uneven_slots_per_rank * self.num_ranks < self.num_logical:
                raise ValueError(f"{self.num_ranks} ranks x {self.uneven_slots_per_rank} slots cannot hold "
                                 f"{self.num_logical} experts")
        elif self.num_logical % self.num_ranks:
            raise ValueError(f"{self.num_logical} experts do not split evenly over {self.num_ranks} EP ranks")

    @property
    def uneven(self) -> bool:
        return self.uneven_slots_per_rank > 0

    @property
    def primary_per_rank(self) -> int:
        if self.uneven:
            raise ValueError("a shrink placement shape has no primary slots")
        return self.num_logical // self.num_ranks

    @property
    def slots_per_rank(self) -> int:
        if self.uneven:
            return self.uneven_slots_per_rank
        return self.primary_per_rank + self.redundant_per_rank

    @property
    def num_slots(self) -> int:
        return self.num_ranks * self.slots_per_rank

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def initial_experts(self, rank: int) -> tuple[int, int]:
        """[first, first + count) of the experts `rank` loads into its first slots at start (its primaries;
        of an uneven shape, its share of a contiguous split, the first E mod N ranks taking one more)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside the placement's {self.num_ranks} EP ranks")
        base, extra = divmod(self.num_logical, self.num_ranks)
        return rank * base + min(rank, extra), base + (rank < extra)

    def default_slots(self) -> list[int]:
        """Each rank's first slots hold its contiguous share of experts (`initial_experts`); the rest are empty."""
        slots = []
        for rank in range(self.num_ranks):
            first, count = self.initial_experts(rank)
            slots.extend(range(first, first + count))
            slots.extend([EMPTY] * (self.slots_per_rank - count))
        return slots


def engine_shape(num_logical: int, num_ranks: int, redundant_per_rank: int) -> PlacementShape:
    """The placement shape of an engine with E experts on N EP ranks and R extra slots per rank: E/N + R slots
    per rank, or where the experts do not split evenly, ceil(E/N) + R slots and no primaries."""
    if num_logical < 1 or num_ranks < 1 or num_logical % num_ranks == 0:
        return PlacementShape(num_logical, num_ranks, redundant_per_rank)
    return PlacementShape(num_logical, num_ranks, 0,
                          uneven_slots_per_rank=-(-num_logical // num_ranks) + redundant_per_rank)


def engine_redundant(shape: PlacementShape) -> int:
    """The R of `engine_shape` that gives `shape` (the inverse; ValueError where none does)."""
    if not shape.uneven:
        return shape.redundant_per_rank
    if shape.num_logical % shape.num_ranks == 0:
        raise ValueError(f"an engine with {shape.num_logical} experts on {shape.num_ranks} EP ranks has primary "
                         f"slots; the uneven shape {shape} is not one it runs")
    return shape.slots_per_rank - -(-shape.num_logical // shape.num_ranks)


def replica_table(slots: list[int], num_logical: int) -> list[list[int]]:
    """Per logical expert, the physical slots holding it (in slot order)."""
    table: list[list[int]] = [[] for _ in range(num_logical)]
    for slot, expert in enumerate(slots):
        if expert != EMPTY:
            table[expert].append(slot)
    return table


def check_slots(shape: PlacementShape, slots: list[int], what: str = "placement") -> None:
    if len(slots) != shape.num_slots:
        raise ValueError(f"{what}: {len(slots)} slots, expected {shape.num_slots}")
    bad = [e for e in slots if e != EMPTY and not 0 <= e < shape.num_logical]
    if bad:
        raise ValueError(f"{what}: logical expert ids out of range: {bad[:5]}")
    missing = [e for e, replicas in enumerate(replica_table(slots, shape.num_logical)) if not replicas]
    if missing:
        raise ValueError(f"{what}: logical experts without any slot: {missing[:10]}")


@dataclass
class ExpertPlacement:
    """A placement for every MoE layer of a model (layer index -> slots)."""

    shape: PlacementShape
    layers: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for layer, slots in self.layers.items():
            check_slots(self.shape, slots, f"layer {layer}")

    @classmethod
    def default(cls, shape: PlacementShape, moe_layers: list[int]) -> ExpertPlacement:
        return cls(shape, {layer: shape.default_slots() for layer in moe_layers})

    def replicas(self, layer: int) -> list[list[int]]:
        return replica_table(self.layers[layer], self.shape.num_logical)

    def to_dict(self) -> dict:
        data = {"format": "meshserve-expert-placement/1", "num_logical": self.shape.num_logical,
                "num_ranks": self.shape.num_ranks, "redundant_per_rank": self.shape.redundant_per_rank}
        if self.shape.uneven:
            data["slots_per_rank"] = self.shape.uneven_slots_per_rank
        data["layers"] = {str(layer): list(slots) for layer, slots in sorted(self.layers.items())}
        data["replicas"] = {str(layer): self.replicas(layer) for layer in sorted(self.layers)}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ExpertPlacement:
        """A placement as `to_dict` writes it; ValueError for anything else (it may come from a client)."""
        if not isinstance(data, dict) or data.get("format") != "meshserve-expert-placement/1":
            raise ValueError("not a meshserve expert placement (format meshserve-expert-placement/1)")
        missing = [key for key in ("num_logical", "num_ranks", "redundant_per_rank", "layers") if key not in data]
        if missing:
            raise ValueError(f"placement is missing {', '.join(missing)}")
        shape = PlacementShape(*(_whole_number(data.get(key, 0), key) for key in
                                 ("num_logical", "num_ranks", "redundant_per_rank", "slots_per_rank")))
        layers = data["layers"]
        if not isinstance(layers, dict) or not all(isinstance(slots, list) for slots in layers.values()):
            raise ValueError("layers must map each layer index to its list of slots")
        return cls(shape, {_whole_number(layer, "a layer index"): [_whole_number(e, f"layer {layer}'s slot")
                                                                   for e in slots]
                           for layer, slots in layers.items()})


def _whole_number(value: object, what: str) -> int:
    """An integer of a placement (JSON object keys are strings of digits); never a float, inf or bool."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.removeprefix("-").isdigit():
        return int(value)
    raise ValueError(f"{what} must be an integer, got {value!r}"[:200])


def placement_json(placement: ExpertPlacement) -> str:
    """The placement as one line of JSON, which `load_placement_file` takes in place of a path (a shrunk
    layout's config carries its placement this way, so ranks on other hosts need no shared file)."""
    data = placement.to_dict()
    del data["replicas"]  # derived from the slots
    return json.dumps(data, separators=(",", ":"))


def is_inline_placement(source: str) -> bool:
    """Whether an `eplb_placement` setting holds the placement's JSON rather than a file path."""
    return source.lstrip().startswith("{")


def describe_placement_source(source: str) -> str:
    """A placement source for messages: the path, or "(inline)" for JSON text."""
    return "(inline)" if is_inline_placement(source) else source


def load_placement_file(source: str) -> ExpertPlacement:
    """A placement JSON file (`meshserve eplb plan --out`), or the JSON text itself (`placement_json`), with a
    one-line error for a bad one."""
    what = describe_placement_source(source)
    try:
        if is_inline_placement(source):
            return ExpertPlacement.from_dict(json.loads(source))
        with open(source) as f:
            return ExpertPlacement.from_dict(json.load(f))
    except OSError as exc:
        raise ValueError(f"cannot read placement {what}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"placement {what}: {exc}") from None
