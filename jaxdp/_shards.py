"""ZeRO stages 1 to 3: which dimension of each leaf is split over the mesh, and the two
packed collectives that bring the gradients in and the parameters back.

A leaf keeps its shape at stages 0 to 2. At stages 1 and 2 it is split over the data
axis along its first dimension whose size divides by ``num_devices``, or kept whole
(replicated) when none does (a scalar, a bias of 10 on 4 devices). At stage 3 (the
parameters split at rest too) it is split along its LAST such dimension other than
the first, a 1-D leaf along its only one: the first dimension of a stack of layers
is the layer axis, which :func:`jaxdp.scan_layers` loops over and must not be split.
Where none of those divides, stage 3 splits it all the same (FSDP2's rule), along the
largest of them (ties: the later one), padded at its end with zeros to a multiple of
the devices; only a scalar stays whole. The padding lives at rest and on the wire
only: every gather returns the logical leaf (sliced after the all-gather), every
reduce-scatter pads the logical gradient with zeros before it, and the update slices
everything to the logical shapes first (:mod:`jaxdp._pipeline`), so neither
``loss_fn`` nor the optimizer ever sees a padded array.
The rule reads the shape alone, so a parameter, its gradient and every
optimizer-state leaf of its shape (momentum, Adam's moments) lie alike, and an
elementwise update needs no communication. The user's optimizer runs on these
logical arrays, outside the mesh map: anything that reads beyond an element (a
global-norm clip, a trust ratio, a factored moment) is partitioned by XLA, which
inserts the collectives it needs, so the update is the one of stage 0 up to the
order of sums (docs/decisions.md, "ZeRO"). Stage 0 is the plan that splits nothing.
Whether a stage splits and by which rule is its :class:`jaxdp._stages.StageLayout`'s.

On the wire the updated blocks are packed: one all-gather per parameter dtype returns
every split leaf (each leaf's rows side by side). The gradients' reduce-scatter is
packed the same way on XLA:CPU (one per dtype); elsewhere each leaf has its own, which
XLA combines into buckets of ``Parallel.bucket_cap_mb`` and schedules as the backward
computes them (:mod:`jaxdp._pipeline`). Either way a step sends one all-reduce's bytes
however many leaves there are.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._mesh import mark_varying, psum
from ._stages import SplitRule, StageLayout


def split_dim(
    shape: tuple[int, ...],
    num_devices: int,
    rule: SplitRule = "first",
    *,
    pad: bool = False,
    taken: tuple[Any, ...] = (),
) -> int | None:
    """The dimension a leaf of ``shape`` is split along by a stage's ``rule``
    (``StageLayout.split_rule``): the first that divides by ``num_devices`` (``"first"``,
    stages 1 and 2), the last but the first (``"last_but_first"``, stage 3: never a
    stack's layer axis; a 1-D leaf its only one); None keeps it whole.

    ``pad`` (``StageLayout.pads``, stage 3): where none of the rule's dimensions divides,
    the largest of them (ties: the later one), which :func:`padded_shape` pads to a
    multiple of ``num_devices``; a scalar, or a leaf of no element, stays whole. A leaf
    with a dimension that divides gets that one, as without ``pad``.

    ``taken``: the leaf's model-axis entries per dimension (:func:`model_specs`); a
    dimension split over a model axis is never split over the data axis too. Where the
    model axes take every dimension ``"last_but_first"`` would choose from (a
    column-split kernel's output dimension), the first is that rule's last resort: a
    stack split so is gathered whole, as a 1-D stack is (:func:`jaxdp._layers.gathered_loss`)."""
    if num_devices == 1:
        return None

    def free(dims: Any) -> list[int]:
        return [k for k in dims if k >= len(taken) or taken[k] is None]

    dims = free(range(len(shape)))
    if rule == "last_but_first" and len(shape) > 1:
        dims = free(range(len(shape) - 1, 0, -1)) or free([0])
    found = next((k for k in dims if shape[k] >= num_devices and shape[k] % num_devices == 0), None)
    if found is not None or not pad or not dims or math.prod(shape) == 0:
        return found
    return max(dims, key=lambda k: (shape[k], k))


def padded_shape(
    shape: tuple[int, ...],
    num_devices: int,
    rule: SplitRule = "first",
    *,
    pad: bool = False,
    taken: tuple[Any, ...] = (),
) -> tuple[int, ...]:
    """``shape`` as a leaf of it rests: its :func:`split_dim` padded up to a multiple of
    ``num_devices`` (``pad``), else as it is."""
    shape, dim = tuple(shape), split_dim(shape, num_devices, rule, pad=pad, taken=taken)
    if dim is None or shape[dim] % num_devices == 0:
        return shape
    return (*shape[:dim], -(-shape[dim] // num_devices) * num_devices, *shape[dim + 1 :])


def resting_size(shapes: Any, num_devices: int, layout: StageLayout) -> int:
    """Elements of leaves of ``shapes`` as ``layout`` holds them split over ``num_devices``:
    each padded as :func:`padded_shape` pads it (what ``jaxdp plan`` and ``jaxdp train``'s
    fit check count at stage 3)."""
    rule, pad = layout.split_rule, layout.pads
    return sum(math.prod(padded_shape(s, num_devices, rule, pad=pad)) for s in shapes)


def pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``x`` with zeros appended at the end of each dimension up to ``shape``."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape, strict=True)])


def slice_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The first ``shape`` elements of ``x`` along each dimension: a padded leaf's logical
    part (inside jit an uneven sharding of it is fine: no collective)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jax.lax.slice(x, (0,) * x.ndim, tuple(shape))


LAYER_AXIS = "layers"
"""The name a model's sharding metadata gives a stack's layer axis (MaxText's, and what
``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`` writes)."""


def name_layer_axis(stack: Any) -> Any:
    """``stack`` (an NNX module made with ``nnx.vmap``) with :data:`LAYER_AXIS` as the
    first sharding name of each of its Variables (``out_sharding``; the others as they
    were, or None), so that a step reads it as a stack of layers. What
    ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`` writes over
    Variables that carry sharding names; jaxdp's models' Variables carry none."""
    from flax import nnx

    for _, node in nnx.iter_graph(stack):
        if isinstance(node, nnx.Variable):
            meta = node.get_metadata()
            rest = meta.get("out_sharding") or (None,) * (len(node.shape) - 1)
            node.set_metadata(out_sharding=(LAYER_AXIS, *rest), eager_sharding=False)
    return stack


def _declared_names(meta: dict[str, Any]) -> tuple[Any, ...]:
    """The sharding names an NNX Variable's metadata declares: its ``out_sharding`` (a
    tuple of names, a ``PartitionSpec`` or a ``NamedSharding``, whose spec is read) or
    ``sharding_names``; ``()``: none."""
    names = meta.get("out_sharding") or meta.get("sharding_names") or ()
    return tuple(getattr(names, "spec", names))


def _named_leaves(tree: Any) -> list[tuple[Any, Any, tuple[Any, ...]]]:
    """``(path, node, names)`` per boxed node of ``tree`` (an NNX Variable, a Linen
    ``nn.Partitioned``) or leaf: the sharding names its metadata gives
    (:func:`_declared_names`, a ``Partitioned``'s ``names``; ``()``: none)."""
    from flax import linen as nn
    from flax import nnx

    def boxed(x: Any) -> bool:
        return isinstance(x, nnx.Variable | nn.Partitioned)

    out = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=boxed)[0]:
        names: tuple[Any, ...] = ()
        if isinstance(node, nnx.Variable):
            names = _declared_names(node.get_metadata())
        elif isinstance(node, nn.Partitioned):
            names = tuple(node.names)
        out.append((path, node, names))
    return out


def _mesh_axes_of(node: Any, names: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The mesh axes ``names`` stand for, as the model's framework maps them when it
    places the leaf: an NNX Variable's through its ``sharding_rules`` and the
    ``nnx.logical_axis_rules`` in force (``nnx.spmd.get_var_pspec``: a name no rule maps
    is kept as a mesh axis name), a ``NamedSharding``'s spec as it is, a Linen
    ``nn.LogicallyPartitioned``'s through its rules or the ``nn.logical_axis_rules`` in
    force (``nn.logical_to_mesh_axes``: a name no rule maps is None). None: the names
    are mesh axes as they are."""
    from flax import linen as nn
    from flax import nnx

    if isinstance(node, nnx.Variable):
        meta = node.get_metadata()
        if hasattr(meta.get("out_sharding"), "spec") or not meta.get("out_sharding"):
            return None
        mapped = tuple(nnx.spmd.get_var_pspec(node))
        return None if mapped == names else mapped
    if isinstance(node, nn.LogicallyPartitioned):
        return tuple(nn.logical_to_mesh_axes(names, node.rules))
    return None


def refuse_axes_the_mesh_lacks(tree: Any, mesh: Mesh) -> None:
    """Refuses a leaf of ``tree`` whose sharding metadata names a mesh axis ``mesh``
    lacks (a tensor-parallel ``"model"`` on a data mesh): jaxdp's step places every leaf
    over its data axes by its own rule and over the model axes (``Parallel.model_axes``)
    as its metadata says, so the leaf would not be split over that axis as the model
    says, a per-device memory the model's author did not plan. Logical names
    are read as the model's framework maps them (:func:`_mesh_axes_of`, under the rules
    in force when the step is given the model); :data:`LAYER_AXIS` (a stack's layer
    axis) is taken.

    Raises:
      ValueError: naming the leaf, its names, the axis and the mesh's axes."""
    axes = set(mesh.axis_names) | {LAYER_AXIS}
    for path, node, names in _named_leaves(tree):
        if not names:
            continue
        mapped = _mesh_axes_of(node, names)
        for entry in names if mapped is None else mapped:
            for axis in entry if isinstance(entry, tuple) else (entry,):
                if isinstance(axis, str) and axis not in axes:
                    said = f"{names}" if mapped is None else f"{names}, by its rules {mapped}"
                    raise ValueError(
                        _AXIS_THE_MESH_LACKS.format(
                            name=jax.tree_util.keystr(path),
                            said=said,
                            axis=axis,
                            mesh=tuple(mesh.axis_names),
                        )
                    )


_AXIS_THE_MESH_LACKS = (
    "params{name}'s sharding metadata ({said}) names the mesh axis {axis!r}, which the "
    "mesh lacks (its axes: {mesh}): jaxdp places every parameter by its own rule over "
    "the mesh's data axes only, so this leaf would not be split over {axis!r} as the "
    "model says. For tensor parallelism give the step a mesh with that axis and name it "
    "in Parallel(model_axes=...); to train the model without it, drop the annotation or "
    "map the name to None in the model's logical axis rules"
)


def model_specs(tree: Any, model_axes: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """Per leaf of ``tree`` (as ``jax.tree.leaves`` lists them): its split over the model
    axes, one entry per dimension (a model axis, a tuple of them, or None), as its
    sharding metadata names them (mapped by the model's framework: :func:`_mesh_axes_of`);
    names of other axes (the data axis, a stack's :data:`LAYER_AXIS`) are None here, as
    the step places the leaf over its data axis by its own rule."""
    out = []
    for _, node, names in _named_leaves(tree):
        mapped = _mesh_axes_of(node, names) if names else None
        entries = tuple(names if mapped is None else mapped)
        for leaf in jax.tree.leaves(node):
            kept = []
            for entry in entries[: jnp.ndim(leaf)]:
                axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)))
                axes = tuple(a for a in axes if a in model_axes)
                kept.append(None if not axes else axes[0] if len(axes) == 1 else axes)
            kept += [None] * (jnp.ndim(leaf) - len(kept))
            out.append(tuple(kept))
    return out


def merged(data: P, model: tuple[Any, ...]) -> P:
    """The spec of a leaf split over the data axis as ``data`` says and over the model axes
    as ``model`` (:func:`model_specs`) says: where it rests, outside the mesh map (inside
    it, the data part alone: the model axes are XLA's)."""
    if not any(e is not None for e in model):
        return data
    entries = list(data) + [None] * (len(model) - len(data))
    for k, e in enumerate(model):
        if e is not None:
            if entries[k] is not None:
                raise AssertionError(f"dimension {k} split over both {entries[k]} and {e}")
            entries[k] = e
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def stacked_leaves(tree: Any, layers: Any = None) -> list[bool]:
    """Per leaf of ``tree``: a stack of layers, its first dimension the layer axis.

    ``layers`` (``Parallel.layers``): None reads the model's own metadata, a leaf whose
    sharding names (an NNX Variable's ``out_sharding`` or ``sharding_names``, a Linen
    ``nn.Partitioned``'s ``names``) start with :data:`LAYER_AXIS`; a sequence of names
    takes the leaves under a key of one of those names (``("blocks",)``); a callable
    takes ``(path, leaf)`` (``path`` as ``jax.tree_util.keystr`` writes it) and says."""
    out = []
    for path, node, names in _named_leaves(tree):
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
        for leaf in jax.tree.leaves(node):
            if layers is None:
                stacked = bool(names) and names[0] == LAYER_AXIS
            elif callable(layers):
                stacked = bool(layers(jax.tree_util.keystr(path), leaf))
            else:
                stacked = any(k in layers for k in keys)
            out.append(stacked and jnp.ndim(leaf) >= 1)
    return out


def spec(dim: int | None, axis_name: str) -> P:
    return P() if dim is None else P(*(None,) * dim, axis_name)


def split_specs(
    tree: Any, num_devices: int, axis_name: str, rule: SplitRule = "first", *, pad: bool = False
) -> Any:
    """:func:`split_dim`'s spec for every leaf of ``tree`` (arrays or shape structs; a
    padded leaf's shape gives the dimension its logical shape does)."""
    return jax.tree.map(
        lambda x: spec(split_dim(x.shape, num_devices, rule, pad=pad), axis_name), tree
    )


def compress(x: jax.Array, wire: Any, num_devices: int) -> jax.Array:
    """``x / num_devices`` in ``wire`` (no-op without one), as torch's
    ``bf16_compress_hook`` divides before it casts, so large sums do not overflow."""
    if wire is None:
        return x
    return (x / jnp.asarray(num_devices, x.dtype)).astype(wire)


def decompress(x: jax.Array, dtype: Any, wire: Any, num_devices: int) -> jax.Array:
    """Back in ``dtype``, times ``num_devices``: the sum again, to the wire's precision."""
    if wire is None:
        return x
    return x.astype(dtype) * jnp.asarray(num_devices, dtype)


def _by_dtype(xs: Any) -> list[list[int]]:
    dtypes = sorted({str(x.dtype) for x in xs})
    return [[i for i, x in enumerate(xs) if str(x.dtype) == t] for t in dtypes]


def packed_all_gather(
    blocks: Any, dims: Any, axis_name: Any, num_devices: int, sizes: Any = None
) -> list[Any]:
    """The whole leaves from every device's ``blocks`` (each split along ``dims[i]``),
    packed: one all-gather per dtype. ``sizes[i]``: the logical size of a padded leaf
    along ``dims[i]``, which the gathered leaf is sliced to (None: not padded)."""
    sizes = sizes or (None,) * len(blocks)
    out = list(blocks)
    for group in _by_dtype(blocks):
        flat = [jnp.moveaxis(blocks[i], dims[i], 0).reshape(-1) for i in group]
        rows = jax.lax.all_gather(jnp.concatenate(flat), axis_name)  # [n, total]
        bounds = np.cumsum([f.size for f in flat])[:-1]
        for i, part in zip(group, jnp.split(rows, bounds, axis=1), strict=True):
            moved = jnp.moveaxis(blocks[i], dims[i], 0).shape
            whole = part.reshape(num_devices * moved[0], *moved[1:])
            if sizes[i] is not None:  # stage 3: the padding ends on the wire
                whole = whole[: sizes[i]]
            out[i] = jnp.moveaxis(whole, 0, dims[i])
    return out


def packed_psum(wholes: Any, axis_name: Any, num_devices: int, wire: Any = None) -> list[Any]:
    """The sum of every device's ``wholes``, packed: one all-reduce per dtype, in
    ``wire`` if given (:func:`compress`)."""
    out = list(wholes)
    for group in _by_dtype(wholes):
        dtype = wholes[group[0]].dtype
        flat = [wholes[i].reshape(-1) for i in group]
        buffer = compress(jnp.concatenate(flat), wire, num_devices)
        summed = decompress(psum(buffer, axis_name), dtype, wire, num_devices)
        bounds = np.cumsum([f.size for f in flat])[:-1]
        for i, part in zip(group, jnp.split(summed, bounds), strict=True):
            out[i] = part.reshape(wholes[i].shape)
    return out


def packed_reduce_scatter(
    wholes: Any,
    dims: Any,
    axis_name: Any,
    num_devices: int,
    wire: Any = None,
    *,
    packed: bool = True,
) -> list[Any]:
    """Each device's block (along ``dims[i]``) of the sum of every device's ``wholes``,
    packed: one reduce-scatter per dtype, in ``wire`` if given (:func:`compress`).
    ``packed=False``: one per leaf, for XLA to combine into buckets and schedule each
    as soon as its leaves are computed. A leaf whose ``dims[i]`` the devices do not
    divide (stage 3's padded leaves, given logical) is padded with zeros at its end to
    a multiple of them first: its block is one of the padded leaf's."""
    n = num_devices
    wholes = [_padded_along(x, d, n) for x, d in zip(wholes, dims, strict=True)]
    out = list(wholes)
    groups = _by_dtype(wholes) if packed else [[i] for i in range(len(wholes))]
    for group in groups:
        dtype = wholes[group[0]].dtype
        rows = [jnp.moveaxis(wholes[i], dims[i], 0).reshape(n, -1) for i in group]
        buffer = compress(jnp.concatenate(rows, axis=1), wire, n)
        summed = jax.lax.psum_scatter(buffer, axis_name, scatter_dimension=0, tiled=False)
        summed = decompress(summed, dtype, wire, n)
        bounds = np.cumsum([r.shape[1] for r in rows])[:-1]
        for i, part in zip(group, jnp.split(summed, bounds), strict=True):
            moved = jnp.moveaxis(wholes[i], dims[i], 0).shape
            out[i] = jnp.moveaxis(part.reshape(moved[0] // n, *moved[1:]), 0, dims[i])
    return out


def on_model_shards(
    fn: Any, xs: Any, models: Any, model_axes: tuple[str, ...], summed: Any = ()
) -> list[Any]:
    """``fn(xs)``, a list of arrays to a list in the same splits over the model axes, run
    on each device's own shards of ``xs`` over them (``models``: per array its
    :func:`model_specs` entries): inside the step's map, which leaves the model axes to
    XLA, jaxdp's collectives over the data axes (stage 3's gathers and their
    reduce-scatters) go on those shards so, and over the data axes only. Left to XLA, a
    packed buffer of model-split leaves was gathered over the model axes first.
    ``summed``: the axes ``fn`` all-reduces over (its results the same along them)."""
    if not any(e is not None for m in models for e in m):
        return fn(list(xs))
    specs = [P(*m) for m in models]
    # check_vma=False: a leaf whole over the model axes comes out the same on each of
    # their devices, which JAX cannot infer where it travelled packed with split ones.
    # Only inside a custom_vjp's rules (jaxdp._layers.gather): nothing differentiates it.
    # Each comes out marked varying over the data axes as its input was, but those it is
    # summed over, as the rules' types must be.
    mapped = jax.shard_map(
        fn,
        in_specs=(specs,),
        out_specs=specs,
        axis_names=frozenset(model_axes),
        check_vma=False,
    )
    out = mapped(list(xs))
    summed = (summed,) if isinstance(summed, str) else tuple(summed)
    varying = [tuple(a for a in _varying_over(x) if a not in summed) for x in xs]
    return [mark_varying(y, v) if v else y for y, v in zip(out, varying, strict=True)]


def _varying_over(x: Any) -> tuple[str, ...]:
    """The manual axes ``x`` varies over inside a ``shard_map`` (jax 0.10 to 0.12 name
    them ``manual_axis_type.varying``; earlier ones ``vma``)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    return tuple(sorted(kind.varying if kind is not None else getattr(aval, "vma", ())))


def unpad_params(params: Any, logical: Any) -> Any:
    """``params`` (a state's) with each leaf the state holds padded sliced to its own
    shape (``TrainState.logical``, a :class:`jaxdp._train_state.LogicalShapes`; None: as
    they are). Inside jit: an uneven sharding there costs no collective."""
    if logical is None:
        return params
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten(
        [x if s is None else slice_to(x, s) for x, s in zip(leaves, logical.params, strict=True)]
    )


def _padded_along(x: jax.Array, dim: int, num_devices: int) -> jax.Array:
    size = x.shape[dim]
    if size % num_devices == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, -(-size // num_devices) * num_devices - size)
    return jnp.pad(x, widths)


class ShardPlan:
    """Where the trainable leaves lie on a mesh at a stage's ``layout``: split along
    :func:`split_dim` by its ``split_rule`` where it splits the optimizer state (ZeRO
    stages 1 to 3), whole at stage 0.

    Built from the trainable tree in the model's own (logical) shapes (frozen leaves are
    ``optax.MaskedNode()``: no leaves); shapes are read, never values. Where the layout
    pads (stage 3), a leaf no dimension of which divides is split along a padded one:
    ``sizes`` holds its logical size there and ``rest`` the shape it rests in. On a
    two-axis (replicas x shards) mesh (HSDP, stage 3) the leaves are split over the
    shard axis, the last, and every replica group holds the same copy; ``num_devices``
    is then a shard group's size.
    ``packed``: the gradients' reduce-scatter packs every leaf into one per dtype
    (XLA:CPU's spelling), else one per leaf (:func:`packed_reduce_scatter`). A leaf
    whose sharding metadata names an axis ``mesh`` lacks is refused
    (:func:`refuse_axes_the_mesh_lacks`).
    """

    def __init__(
        self,
        trainable: Any,
        mesh: Mesh,
        layout: StageLayout,
        *,
        packed: bool = True,
        layers: Any = None,
        model_axes: tuple[str, ...] = (),
        optimizer: Any = None,
    ):
        refuse_axes_the_mesh_lacks(trainable, mesh)
        leaves, self.treedef = jax.tree.flatten(trainable)
        self.stacked = stacked_leaves(trainable, layers)
        self.packed = packed
        self.model_axes, self.optimizer = model_axes, optimizer
        # The data axes: the mesh's but the model's (HSDP's replica and shard axes).
        self.data_axes = tuple(a for a in mesh.axis_names if a not in model_axes)
        self.data_size = math.prod(mesh.shape[a] for a in self.data_axes)
        self.mesh, self.axis_name = mesh, self.data_axes[-1]
        self.num_devices, self.layout = mesh.shape[self.axis_name], layout
        # HSDP: the replica axis, over which the blocks are all-reduced once per step.
        self.replica_axis = self.data_axes[0] if len(self.data_axes) == 2 else None
        self.shapes = [tuple(x.shape) for x in leaves]
        # Per leaf: its split over the model axes (all None without any).
        self.model = model_specs(trainable, model_axes)
        rule, n, pad = layout.split_rule, self.num_devices, layout.pads
        self.dims = [
            split_dim(s, n, rule, pad=pad, taken=m) if layout.state_split else None
            for s, m in zip(self.shapes, self.model, strict=True)
        ]
        self.split = any(d is not None for d in self.dims)
        # Per leaf: the logical size along its split dimension where it rests padded.
        self.sizes = [
            None if d is None or s[d] % n == 0 else s[d]
            for s, d in zip(self.shapes, self.dims, strict=True)
        ]
        self.rest = [
            padded_shape(s, n, rule, pad=pad, taken=m)
            for s, m in zip(self.shapes, self.model, strict=True)
        ]
        self.padded = any(x is not None for x in self.sizes)

    def specs(self, whole: P | None = None) -> Any:
        """The trainable tree's specs over the data axis (a gradient's, a parameter
        block's, inside the mesh map); ``whole`` for the leaves kept whole."""
        whole = P() if whole is None else whole
        return self.treedef.unflatten(
            [whole if d is None else spec(d, self.axis_name) for d in self.dims]
        )

    def rest_specs(self) -> Any:
        """:meth:`specs` with each leaf's split over the model axes: how the leaves lie
        outside the mesh map."""
        return self.treedef.unflatten(
            [merged(spec(d, self.axis_name), m) for d, m in zip(self.dims, self.model, strict=True)]
        )

    def window_specs(self, rows: P) -> Any:
        """The multisteps window's gradient sums at stages 2 and 3: a whole leaf's
        ``rows`` (per device), a split leaf's global sum by the plan; under HSDP each
        replica group's own sum, on a leading axis over the replica axis."""
        if self.replica_axis is None:
            return self.specs(whole=rows)
        return self.treedef.unflatten(
            [
                rows if d is None else P(self.replica_axis, *(None,) * d, self.axis_name)
                for d in self.dims
            ]
        )

    def state_specs(self, opt_state: Any) -> Any:
        """The optimizer state's specs, as it rests: split over the data axis by its
        leaves' own shapes when the plan splits anything (stages 1 to 3), else
        replicated; and over the model axes as the parameter whose tree a leaf mirrors
        (:meth:`state_model`), along another dimension than the data split."""
        leaves, treedef = jax.tree.flatten(opt_state)
        model = self.state_model(opt_state)
        rule, n, pad = self.layout.split_rule, self.num_devices, self.layout.pads
        out = []
        for x, m in zip(leaves, model, strict=True):
            dim = split_dim(x.shape, n, rule, pad=pad, taken=m) if self.split else None
            out.append(merged(spec(dim, self.axis_name), m))
        return treedef.unflatten(out)

    def state_model(self, opt_state: Any) -> list[tuple[Any, ...]]:
        """Per leaf of the optimizer state: its split over the model axes. A leaf in a
        copy of the parameters' tree (Adam's moments, a momentum) takes its parameter's
        (``optax.tree_map_params``); where the optimizer's state cannot be read so (its
        ``init`` reads values), a leaf of a parameter's shape takes that parameter's if
        every parameter of the shape has the same; every other leaf none."""
        leaves = jax.tree.leaves(opt_state)
        if not any(e is not None for m in self.model for e in m):
            return [()] * len(leaves)
        none = P()
        splits = self.treedef.unflatten([P(*m) for m in self.model])
        try:
            found = jax.tree.leaves(
                optax.tree_map_params(
                    self.optimizer,
                    lambda _, m: m,
                    opt_state,
                    splits,
                    transform_non_params=lambda x: jax.tree.map(lambda _: none, x),
                )
            )
        except Exception:  # an optimizer whose init reads its parameters' values
            found = None
        if found is None or len(found) != len(leaves):
            by_shape: dict[tuple[int, ...], set[tuple[Any, ...]]] = {}
            for shape, m in zip(self.shapes, self.model, strict=True):
                by_shape.setdefault(shape, set()).add(m)
            found = [
                P(*next(iter(by_shape[x.shape])))
                if len(by_shape.get(tuple(x.shape), ())) == 1
                else none
                for x in leaves
            ]
        return [
            tuple(f) + (None,) * (len(x.shape) - len(f)) for f, x in zip(found, leaves, strict=True)
        ]

    # ---- the padding (stage 3), on the logical arrays outside the map -------------------

    def pad(self, tree: Any) -> Any:
        """The trainable ``tree`` (logical) as it rests: each padded leaf with zeros
        appended along its split dimension (no-op where nothing is padded)."""
        if not self.padded:
            return tree
        leaves = self._split_leaves(tree)
        return self.treedef.unflatten(
            [pad_to(x, r) for x, r in zip(leaves, self.rest, strict=True)]
        )

    def unpad(self, tree: Any) -> Any:
        """The trainable ``tree`` as it rests, each padded leaf sliced to its logical shape."""
        if not self.padded:
            return tree
        leaves = self._split_leaves(tree)
        return self.treedef.unflatten(
            [slice_to(x, s) for x, s in zip(leaves, self.shapes, strict=True)]
        )

    def pad_state(self, opt_state: Any) -> Any:
        """The optimizer state (logical) as it rests: each leaf padded by the rule on its
        own shape, as a parameter of that shape is (also where no parameter is: a
        placeholder of shape ``(1,)``, as adafactor keeps, rests as ``(n,)``)."""
        if not (self.split and self.layout.pads):
            return opt_state
        n, rule = self.num_devices, self.layout.split_rule
        leaves, treedef = jax.tree.flatten(opt_state)
        model = self.state_model(opt_state)
        return treedef.unflatten(
            [
                pad_to(x, padded_shape(x.shape, n, rule, pad=True, taken=m))
                for x, m in zip(leaves, model, strict=True)
            ]
        )

    def unpad_state(self, opt_state: Any, like: Any) -> Any:
        """The optimizer state as it rests, each leaf sliced to ``like``'s (the logical
        shapes, ``optimizer.init``'s on the logical parameters)."""
        if not (self.split and self.layout.pads):
            return opt_state
        return jax.tree.map(lambda x, k: slice_to(x, k.shape), opt_state, like)

    def _split_leaves(self, tree: Any) -> list[Any]:
        return self.treedef.flatten_up_to(tree)

    def whole(self, tree: Any) -> list[Any]:
        """The leaves the plan keeps whole, in order."""
        leaves = self._split_leaves(tree)
        return [x for x, d in zip(leaves, self.dims, strict=True) if d is None]

    def with_whole(self, tree: Any, whole: list[Any]) -> Any:
        """``tree`` with its whole leaves replaced by ``whole`` (as :meth:`whole` lists them)."""
        it = iter(whole)
        leaves = self._split_leaves(tree)
        return self.treedef.unflatten(
            [next(it) if d is None else x for x, d in zip(leaves, self.dims, strict=True)]
        )

    def with_blocks(self, tree: Any, blocks: list[Any]) -> Any:
        """``tree`` with its split leaves replaced by ``blocks`` (as :meth:`blocks` lists them)."""
        it = iter(blocks)
        leaves = self._split_leaves(tree)
        return self.treedef.unflatten(
            [x if d is None else next(it) for x, d in zip(leaves, self.dims, strict=True)]
        )

    def blocks(self, tree: Any) -> list[Any]:
        """The split leaves, in order (inside the map: this device's blocks)."""
        leaves = self._split_leaves(tree)
        return [x for x, d in zip(leaves, self.dims, strict=True) if d is not None]

    # ---- inside the mesh map -----------------------------------------------------------

    def reduce_scatter(self, tree: Any, wire: Any = None, done: Any = None) -> Any:
        """The reduce-scatter of every split leaf of this device's ``tree`` (one per
        dtype if ``packed``, else one per leaf): each device gets its block of the
        global sum. Whole leaves, and those ``done`` (per leaf: scattered already, in
        :func:`jaxdp.scan_layers`' backward), come back as they were."""
        if not self.split:
            return tree
        leaves = self._split_leaves(tree)
        done = done or (False,) * len(self.dims)
        which = [i for i, d in enumerate(self.dims) if d is not None and not done[i]]
        if not which:
            return tree
        dims = [self.dims[i] for i in which]

        def scattered(wholes: list[Any]) -> list[Any]:
            return packed_reduce_scatter(
                wholes, dims, self.axis_name, self.num_devices, wire, packed=self.packed
            )

        blocks = on_model_shards(
            scattered, [leaves[i] for i in which], [self.model[i] for i in which], self.model_axes
        )
        for i, block in zip(which, blocks, strict=True):
            leaves[i] = block
        return self.treedef.unflatten(leaves)

    # ---- on the logical arrays, outside the map ----------------------------------------

    def local(self, tree: Any) -> Any:
        """``tree`` (replicated) constrained to the plan's layout: each device keeps its
        block of a split leaf, a slice, no communication."""
        if not self.split:
            return tree
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.rest_specs())
        return jax.lax.with_sharding_constraint(tree, shardings)

    def constrain(self, opt_state: Any) -> Any:
        """The optimizer state held in :meth:`state_specs`' layout."""
        if not self.split:
            return opt_state
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs(opt_state))
        return jax.lax.with_sharding_constraint(opt_state, shardings)

    def at_rest(self, tree: Any) -> Any:
        """The updated parameters as the state keeps them: whole at stages 0 to 2 (one
        all-gather per dtype, :meth:`gather`), split where they rest split (stage 3,
        ``layout.params_split``: padded, nothing gathered)."""
        return self.local(self.pad(tree)) if self.layout.params_split else self.gather(tree)

    def gather(self, tree: Any) -> Any:
        """The whole leaves from every device's block: one all-gather per dtype."""
        if not self.split:
            return tree
        leaves = self._split_leaves(tree)
        specs = self.treedef.flatten_up_to(self.rest_specs())
        # check_vma=False: the all-gather's result is the same on every device, which
        # jax 0.10 cannot express without a private function (all_gather_invariant).
        # Manual over the model axes too: each device gathers its own model shards.
        gathered = jax.shard_map(
            self._gather_blocks,
            mesh=self.mesh,
            in_specs=(specs,),
            out_specs=[merged(P(), m) for m in self.model],
            axis_names=frozenset(self.data_axes + self.model_axes),
            check_vma=False,
        )(leaves)
        return self.treedef.unflatten(gathered)

    def _gather_blocks(self, leaves: list[Any]) -> list[Any]:
        out = list(leaves)
        which = [i for i, d in enumerate(self.dims) if d is not None]
        wholes = packed_all_gather(
            [leaves[i] for i in which],
            [self.dims[i] for i in which],
            self.axis_name,
            self.num_devices,
            [self.sizes[i] for i in which],
        )
        for i, whole in zip(which, wholes, strict=True):
            out[i] = whole
        return out
