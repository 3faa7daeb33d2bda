"""The DISCO kernel space: the table of valid kernels (TILES, the single source of truth),
the compile-time config of one kernel binary, and the name grammar with
`parse_kernel_name(kernel_name(cfg)) == cfg`; and the problem those kernels run (DiscoProblem,
with the precisions and bases its fields take), which the families (tilecast/families/disco.py)
and the feature engine (tilecast/features/disco.py) both read from here. The C++ tables the
rows mirror are named at TILES; what runs each variant in DiscoConvS2 is
tilecast/disco/variants.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tilecast.core.family import FamilyError, table_choice

DIRECTIONS = {"forward": 0, "backward": 1}          # name -> TC_DISCO_DIR


@dataclass(frozen=True)
class VariantSpec:
    """What a variant's kernels need: its TC_DISCO_VARIANT code, the config fields a TILES row
    gives (in kernel-name order), whether psi must have the kpacked layout, and whether the
    kernel takes a latitude block (the line-blocked transpose's work item is fixed: one
    channel by one block of input lines; its configs have lat_block 1)."""
    code: int
    tile_fields: tuple[str, ...]
    kpacked_layout: bool
    lat_blocked: bool = True


VARIANTS = {"csr": VariantSpec(0, ("bt", "nv"), False),
            "kpacked": VariantSpec(1, ("kreg", "nv"), True),
            "lines": VariantSpec(2, ("lb", "nv"), False, lat_blocked=False)}
# the value a config field takes in variants whose tiles do not name it
UNUSED_TILE_FIELD = {"bt": 1, "kreg": 0, "lb": 0}
ISAS = {"avx512": 1, "avx2": 0}                     # name -> TC_DISCO_ISA
# what an ISA's build needs of the CPU; -march=native targets AVX-512 where the CPU has it, so
# an avx2 build only exists on a CPU without it
ISA_FLAGS = {"avx512": ({"avx512f"}, set()), "avx2": ({"avx2", "fma"}, {"avx512f"})}
LANES = {"avx512": 16, "avx2": 8}                   # float32 lanes per vector

# The single source of truth for valid kernels: (direction, variant, isa) -> tiles in the
# variant's tile_fields order: (BT, NV) in the order of Variants<Elem> in
# kernels/cpu/disco/disco_csr_variants.hpp, (KREG, NV) in that of PackedVariants<Elem> in
# kernels/cpu/disco/disco_kpacked_variants.hpp, (LB, NV) the line-blocked transpose's one tile
# (kLineBlock x kLineVectors in kernels/cpu/disco/disco_lines_transpose.hpp).
TILES: dict[tuple[str, str, str], tuple[tuple[int, int], ...]] = {
    ("forward", "csr", "avx512"): ((1, 8), (1, 6), (1, 5), (1, 4)),
    ("forward", "csr", "avx2"): ((1, 12), (1, 10), (1, 8), (1, 6)),
    ("backward", "csr", "avx512"): ((8, 2), (8, 1), (4, 4), (4, 3), (4, 2), (1, 8), (1, 6),
                                    (1, 5), (1, 4)),
    ("backward", "csr", "avx2"): ((8, 1), (4, 3), (4, 2), (1, 12), (1, 10), (1, 8), (1, 6)),
    ("forward", "kpacked", "avx512"): ((16, 1), (12, 2), (9, 3), (6, 4), (4, 6), (3, 8), (1, 8)),
    ("forward", "kpacked", "avx2"): ((16, 1), (12, 1), (6, 2), (5, 2), (4, 3), (3, 3), (3, 4),
                                    (1, 8)),
    ("backward", "lines", "avx512"): ((4, 6),),
    ("backward", "lines", "avx2"): ((4, 3),),
}
# (direction, variant) -> the tilecast.disco.native function running a named tile, and the
# config fields its `tile` argument takes
RUNTIME = {("forward", "csr"): ("contraction", ("nv", "lat_block")),
           ("backward", "csr"): ("transpose_contraction", ("bt", "nv", "lat_block")),
           ("forward", "kpacked"): ("kpacked_contraction", ("kreg", "nv", "lat_block")),
           ("backward", "lines"): ("transpose_lines", ())}
# latitude blocks built by default (the runtime's own defaults: 8 forward, 4 backward)
LAT_BLOCKS = {"forward": (4, 8, 16), "backward": (2, 4, 8)}
MAX_LAT_BLOCK = 64

# {tile}: the variant's tile fields with their values, bt{BT}_nv{NV} (csr), kreg{KREG}_nv{NV}
# (kpacked), lb{LB}_nv{NV} (lines)
NAME_GRAMMAR = "disco_{direction}_{variant}_{isa}_{tile}_lat{lat_block}"
NAME_RE = re.compile(r"^disco_(?P<direction>[a-z]+)_(?P<variant>[a-z0-9]+)_(?P<isa>[a-z0-9]+)"
                     r"_(?P<tile>(?:[a-z]+\d+_)+)lat(?P<lat>\d+)$")
TILE_PART_RE = re.compile(r"([a-z]+)(\d+)_")


@dataclass(frozen=True, order=True)
class DiscoConfig:
    """Every compile-time parameter of one DISCO kernel binary. bt: channels per register
    tile; kreg: basis functions per register tile (kpacked; 0 for csr, whose rows hold one);
    lb: input lines per register tile (lines; 0 for the others)."""
    direction: str
    variant: str
    isa: str
    bt: int
    nv: int
    lat_block: int
    kreg: int = 0
    lb: int = 0

    @property
    def tile_lons(self) -> int:
        """Output longitudes one register tile holds."""
        return self.nv * LANES[self.isa]

    def tile(self) -> tuple[int, ...]:
        """The `tile` argument of the tilecast.disco.native entry running this kernel
        (RUNTIME): (nv, lat_block) contraction, (bt, nv, lat_block) transpose_contraction,
        (kreg, nv, lat_block) kpacked_contraction, () transpose_lines (its one tile)."""
        return tuple(getattr(self, name) for name in RUNTIME[self.direction, self.variant][1])

    def runtime_entry(self) -> str:
        """The tilecast.disco.native function that runs this kernel with tile=self.tile()."""
        return RUNTIME[self.direction, self.variant][0]


_choice = table_choice


def validate_config(cfg) -> DiscoConfig:
    """Raise FamilyError naming the offending field unless cfg is a row of TILES with a
    latitude block in [1, MAX_LAT_BLOCK]."""
    if not isinstance(cfg, DiscoConfig):
        raise FamilyError(f"not a disco config: {cfg!r}")
    ctx = f"disco config {cfg}"
    _choice(cfg.direction, DIRECTIONS, "direction", ctx)
    _choice(cfg.variant, VARIANTS, "variant", ctx)
    _choice(cfg.isa, ISAS, "isa", ctx)
    tiles = TILES.get((cfg.direction, cfg.variant, cfg.isa))
    if tiles is None:
        rows = ", ".join("/".join(key) for key in TILES)
        raise FamilyError(f"no {cfg.variant} {cfg.direction} kernels for {cfg.isa} in {ctx}; "
                          f"the table has {rows}")
    tile_fields = VARIANTS[cfg.variant].tile_fields
    for name, unused in UNUSED_TILE_FIELD.items():
        if name not in tile_fields and getattr(cfg, name) != unused:
            raise FamilyError(f"{name}={getattr(cfg, name)!r} in {ctx}: {cfg.variant} tiles do "
                              f"not name {name}; it must be {unused}")
    tile = tuple(getattr(cfg, name) for name in tile_fields)
    if tile not in tiles:
        spelled = " x ".join(f"{n}{v}" for n, v in zip(tile_fields, tile))
        raise FamilyError(f"tile {spelled} is not instantiated for "
                          f"{cfg.direction}/{cfg.variant}/{cfg.isa}; valid ({', '.join(tile_fields)}): "
                          f"{', '.join('x'.join(map(str, t)) for t in tiles)}")
    if isinstance(cfg.lat_block, bool) or not isinstance(cfg.lat_block, int) \
            or not 1 <= cfg.lat_block <= MAX_LAT_BLOCK:
        raise FamilyError(f"lat_block={cfg.lat_block!r} in {ctx} must be an integer in "
                          f"[1, {MAX_LAT_BLOCK}]")
    if not VARIANTS[cfg.variant].lat_blocked and cfg.lat_block != 1:
        raise FamilyError(f"lat_block={cfg.lat_block!r} in {ctx}: {cfg.variant} kernels take no "
                          "latitude block (one work item per channel and block of input lines); "
                          "it must be 1")
    return cfg


def kernel_name(cfg: DiscoConfig) -> str:
    """The unique name of a kernel; parse_kernel_name inverts it."""
    validate_config(cfg)
    tile = "_".join(f"{name}{getattr(cfg, name)}" for name in VARIANTS[cfg.variant].tile_fields)
    return f"disco_{cfg.direction}_{cfg.variant}_{cfg.isa}_{tile}_lat{cfg.lat_block}"


def parse_kernel_name(name: str) -> DiscoConfig:
    """The DiscoConfig a kernel name spells; FamilyError says what is wrong."""
    match = NAME_RE.match(name) if isinstance(name, str) else None
    if not match:
        raise FamilyError(f"not a disco kernel name: {name!r}; expected {NAME_GRAMMAR}")
    g = match.groupdict()
    try:
        variant = _choice(g["variant"], VARIANTS, "variant", f"kernel name {name!r}")
        tile = {field: int(value) for field, value in TILE_PART_RE.findall(g["tile"])}
        expected = VARIANTS[variant].tile_fields
        if tuple(tile) != expected:
            raise FamilyError(f"the tile spells fields ({', '.join(tile)}); {variant} tiles are "
                              f"{'_'.join(f'{f}<int>' for f in expected)}")
        return validate_config(DiscoConfig(g["direction"], variant, g["isa"],
                                           lat_block=int(g["lat"]),
                                           **{**UNUSED_TILE_FIELD, **tile}))
    except FamilyError as err:
        raise FamilyError(f"invalid kernel name {name!r}: {err}") from None


# -- problems ------------------------------------------------------------------------------

PRECISIONS = ("fp32", "bf16", "fp16")
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# problem field value -> tilecast.disco basis_type
BASES = {"harmonic": "harmonic", "piecewise_linear": "piecewise linear"}


@dataclass(frozen=True, order=True)
class DiscoProblem:
    """One contraction (tilecast/families/disco.py: make_problem builds a validated one);
    kernel_shape is 'AxB', theta_cutoff rounded to 6 significant digits so that it survives a
    round trip through text."""
    batch: int
    channels: int
    nlat_in: int
    nlon_in: int
    nlat_out: int
    nlon_out: int
    kernel_shape: str
    basis: str
    grid_in: str
    grid_out: str
    theta_cutoff: float
    precision: str

    @property
    def bc(self) -> int:
        return self.batch * self.channels

    @property
    def stride(self) -> int:
        return self.nlon_in // self.nlon_out

    @property
    def kernel_size(self) -> int:
        return kernel_size(self.basis, self.kernel_shape)

    def psi_key(self) -> tuple:
        """The fields psi depends on (not batch, channels or precision)."""
        return (self.nlat_in, self.nlon_in, self.nlat_out, self.nlon_out, self.kernel_shape,
                self.basis, self.grid_in, self.grid_out, self.theta_cutoff)


def shape_tuple(kernel_shape: str) -> tuple[int, ...]:
    """'AxB' -> (A, B)."""
    return tuple(int(v) for v in kernel_shape.split("x"))


def piecewise_linear_size(n_rings: int, n_sectors: int) -> int:
    """K of the piecewise linear basis: a hat per ring and sector off the centre, and one at
    the centre, shared by the sectors, when n_rings is odd (tilecast.disco.basis)."""
    return (n_rings // 2) * n_sectors + n_rings % 2


def harmonic_size(n_y: int, n_x: int) -> int:
    """K of the harmonic basis: one function per (y, x) index pair (tilecast.disco.basis)."""
    return n_y * n_x


#: a basis_type's K from its kernel_shape pair: the one definition tilecast.disco.basis's
#: classes and the kernel space (the dispatcher and the feature engine, which must not import
#: torch) both read
BASIS_SIZES = {"piecewise linear": piecewise_linear_size, "harmonic": harmonic_size}


def kernel_size(basis: str, kernel_shape: str) -> int:
    """K, the basis functions of a problem's basis (a BASES key) and kernel_shape ('AxB')."""
    first, second = shape_tuple(kernel_shape)
    return BASIS_SIZES[BASES[basis]](first, second)
