"""The toy spec that the experiment tests share (2 arms x 2 seeds x 2 steps at smoke size) and
a writer of it with fields changed."""

from pathlib import Path

TOY = {
    "name": "toy", "kind": "sweep", "preset": "smoke", "seeds": [0, 1],
    "settings": {"steps": 60, "checkpoint_every": 10, "early_every": 0, "cse_samples": 64, "min_cluster_size": 5,
                 "min_samples": 3, "eval_max_blocks": 20},
    "trunk": {"layers": [0, 1], "gc_peak_step": 10},
    "arms": [{"name": "dense", "kind": "dense"},
             {"name": "cse", "kind": "cse", "convert_at": [20, 40]},
             {"name": "null", "kind": "null", "convert_at": [20, 40]}],
    "criteria": {"arms": ["cse-at20", "cse-at40"]},
}


def toy_file(tmp_path, **changes) -> Path:
    import tomli_w

    path = tmp_path / "toy.toml"
    path.write_text(tomli_w.dumps({**TOY, **changes}))
    return path
