"""The loader's sources (issue 26): a Hugging Face Dataset in any format gives its numpy
batch, a batched source is read once per call, a grain MapDataset equals the same arrays,
and a loader made from the step takes its path and split from it."""

import subprocess
import sys

import grain
import numpy as np
import optax
import pytest

import jaxdp
import jaxdp.data

# datasets is imported where it is used: every xdist worker collects this file, and the
# import costs about 2.7 CPU s.

SIZES = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=3)  # 12 rows a step
N = 40


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(N, 6)).astype(np.float32), "y": rng.integers(0, 4, N)}


def records(source):
    return [{"x": source["x"][i], "y": source["y"][i]} for i in range(N)]


def read_all(source, **kwargs):
    """Every call of one epoch (shuffled), as host arrays."""
    mesh = jaxdp.data_mesh(2)
    with jaxdp.data.Loader(source, SIZES, mesh=mesh, epochs=1, seed=7, **kwargs) as loader:
        return [{k: np.asarray(v) for k, v in b.data.items()} for b in loader]


def assert_same_batches(got, want):
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for name in w:
            assert g[name].dtype == w[name].dtype and g[name].shape == w[name].shape
            np.testing.assert_array_equal(g[name], w[name])


@pytest.mark.parametrize("form", [None, "numpy", "torch", "arrow", "pandas"])
def test_a_hugging_face_dataset_in_any_format_gives_the_numpy_batch(form):
    """The default (python) format used to reach the loss as a list of 6 columns, x
    transposed to (6, rows): every format now reads as ``with_format("numpy")``."""
    import datasets

    source = arrays()
    dataset = datasets.Dataset.from_dict(source).with_format(form)
    got = read_all(dataset)
    assert got[0]["x"].shape == (12, 6)
    assert_same_batches(got, read_all(source))


def test_a_hugging_face_formats_columns_are_kept_and_a_transform_sees_numpy_records():
    import datasets

    source = arrays()
    only_x = datasets.Dataset.from_dict(source).with_format("torch", columns=["x"])
    assert_same_batches(read_all(only_x), read_all({"x": source["x"]}))
    seen = []

    def double(record):
        seen.append(type(record["x"]))
        return {**record, "x": record["x"] * 2}

    got = read_all(datasets.Dataset.from_dict(source), transform=double)
    want = read_all({**source, "x": source["x"] * 2})
    assert_same_batches(got, want)
    assert set(seen) == {np.ndarray}


class Batched:
    """A source with ``__getitems__``: counts its batched reads; a record read fails."""

    def __init__(self, source):
        self.source, self.calls = source, []

    def __len__(self):
        return N

    def __getitem__(self, index):
        raise AssertionError(f"record {index} read alone")

    def __getitems__(self, rows):
        self.calls.append(list(rows))
        return [{"x": self.source["x"][i], "y": self.source["y"][i]} for i in rows]


def test_a_batched_source_is_read_once_per_call_with_the_calls_rows():
    source = arrays()
    batched = Batched(source)
    got = read_all(batched)
    assert_same_batches(got, read_all(source))
    schedule = jaxdp.epoch_schedule(N, SIZES, seed=7).rows
    assert sorted(batched.calls) == sorted(rows.tolist() for rows in schedule)


def test_a_batched_read_of_another_length_is_refused_naming_the_counts():
    class Short(Batched):
        def __getitems__(self, rows):
            return super().__getitems__(rows)[:-1]

    with pytest.raises(ValueError, match=r"batched read of 12 records .* returned 11: it must"):
        read_all(Short(arrays()))


def test_a_hugging_face_dataset_is_read_with_one_batched_index_per_call():
    import datasets

    class Counted(datasets.Dataset):  # with_format copies it: the copy counts too
        reads = []

        def __getitem__(self, key):
            type(self).reads.append(key)
            return super().__getitem__(key)

    source = arrays()
    dataset = Counted(datasets.Dataset.from_dict(source).data)
    assert_same_batches(read_all(dataset), read_all(source))
    assert [len(k) for k in Counted.reads if isinstance(k, list)] == [12, 12, 12]
    assert not [k for k in Counted.reads if not isinstance(k, list)]


def test_a_grain_map_dataset_reads_as_the_same_arrays():
    source = arrays()
    mapped = grain.MapDataset.source(records(source)).map(lambda r: {**r, "y": r["y"] + 1})
    assert_same_batches(read_all(mapped), read_all({**source, "y": source["y"] + 1}))


def test_a_grain_map_dataset_with_holes_or_endless_is_refused():
    dataset = grain.MapDataset.source(records(arrays()))
    with pytest.raises(ValueError, match=r"source record \d+ is None \(a grain MapDataset's filt"):
        read_all(dataset.filter(lambda r: r["y"] != 2))
    with pytest.raises(ValueError, match=r"grain MapDataset of length 9223372036854775807 \(end"):
        read_all(dataset.repeat())


def test_jaxdp_imports_datasets_only_when_given_one():
    code = (
        "import sys, numpy as np, jaxdp, jaxdp.data; jaxdp.emulate_cpu_devices(2);"
        "s = jaxdp.batch_sizes(num_devices=2, micro_batch_size=2);"
        "l = jaxdp.data.Loader(np.arange(8.0), s, mesh=jaxdp.data_mesh(2)); l.state();"
        "next(iter(l)); l.close(); print('datasets' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_resume_on_a_changed_hugging_face_dataset_is_refused():
    import datasets

    saved = jaxdp.data.Loader(datasets.Dataset.from_dict(arrays()), SIZES, mesh=jaxdp.data_mesh(2))
    state = saved.state()
    assert state["fingerprint"]["covers"] == "every row"
    assert state["fingerprint"]["fields"] == {"['x']": "float32[6]", "['y']": "int64[]"}
    same = datasets.Dataset.from_dict(arrays()).with_format("torch")  # another format
    assert jaxdp.data.Loader(same, SIZES, mesh=jaxdp.data_mesh(2)).restore(state) == (0, 0, 0)
    changed = arrays()
    changed["x"][31, 4] += 1.0
    other = jaxdp.data.Loader(datasets.Dataset.from_dict(changed), SIZES, mesh=jaxdp.data_mesh(2))
    with pytest.raises(ValueError, match=r"other data: the same shapes with other contents \(SHA"):
        other.restore(state)


# ---- a loader made from the step ------------------------------------------------------


def make_step(path, accum_steps=2, devices=2):
    return jaxdp.make_train_step(
        lambda p, b: ((b["x"] @ p) ** 2).mean(),
        optax.sgd(0.1),
        mesh=jaxdp.data_mesh(devices),
        accum_steps=accum_steps,
        path=path,
    )


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_a_loader_for_the_step_takes_its_path_mesh_and_split(path):
    step = make_step(path)
    loader = jaxdp.data.Loader.for_step(step, arrays(), micro_batch_size=3, epochs=1)
    assert (loader.path, loader.mesh, loader.sizes) == (path, step.mesh, SIZES)
    by_global = jaxdp.data.Loader.for_step(step, arrays(), global_batch_size=12)
    assert by_global.sizes == SIZES
    state = step.init(np.zeros(6, np.float32))
    with loader:
        for batch in loader:
            state, _ = step(state, batch)
    assert int(state.step) == 3


def test_a_loader_for_the_step_refuses_what_the_step_decides_and_a_bad_size():
    step = make_step("multisteps")
    with pytest.raises(TypeError, match=r"for_step takes mesh, path from the step \(path='mul"):
        jaxdp.data.Loader.for_step(step, arrays(), micro_batch_size=3, path="fused", mesh=None)
    with pytest.raises(ValueError, match=r"global_batch_size=10 must be a positive multiple of "):
        jaxdp.data.Loader.for_step(step, arrays(), global_batch_size=10)


def test_a_loader_built_apart_from_the_step_is_refused_at_the_first_call_naming_both():
    step = make_step("fused", accum_steps=3)
    mesh = jaxdp.data_mesh(2)
    with jaxdp.data.Loader(arrays(), SIZES, mesh=mesh, path="multisteps") as loader:
        batch = next(iter(loader))
    with pytest.raises(
        ValueError,
        match=r"comes from a Loader with path='multisteps', global_batch_size=12 = num_devices"
        r"=2 x accum_steps=2 x micro_batch_size=3; this step has path='fused', num_devices=2, "
        r"accum_steps=3: .*Loader.for_step\(step, source, micro_batch_size=...\)",
    ):
        step(step.init(np.zeros(6, np.float32)), batch)
