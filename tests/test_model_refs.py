"""Model references (a folder, tiny:<name>, a hub id org/name[@revision]) resolve on the driver before Ray or any
worker starts, everywhere a model is named: the short API, `hybridrl train` (every model option), `hybridrl plan`,
`hybridrl convert` and `hybridrl submit` (which pins hub ids to their commit and checks that the job's nodes see
the files). Roles without a pool share ResourcePool.default(); `parallel_config=` is `parallel=`.

No network to the hub here: an offline cache (tests/hub_cache.py) serves tiny models under hub ids, with
HF_HUB_OFFLINE=1, so nothing waits on a network timeout. Nothing in this module starts Ray.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hub_cache import commit_of, offline_hub, put_in_hub_cache

import hybridrl
from hybridrl.cli import main as cli_main
from hybridrl.controller import resource_pool
from hybridrl.controller.resource_pool import ResourcePool, ResourcePoolError
from hybridrl.models.hub import ModelReferenceError, pinned_reference, resolve_model
from hybridrl.models.peft import tokenizer_folder
from hybridrl.models.tiny import create_tiny_model, default_model_dir

REPO, RM_REPO, LORA_REPO = "acme/tiny-llama", "acme/tiny-rm", "acme/tiny-rm-lora"
INIT_REPO = "acme/tiny-llama-adapters"  # starting adapters (lora.init) over the bundled tiny Llama
OLD = commit_of(REPO, "old")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama (the bundled character tokenizer's vocabulary, with its files) and a reward model, as local
    folders."""
    from hybridrl.data.tokenizer import VOCAB_SIZE, create_char_tokenizer

    root = tmp_path_factory.mktemp("refs")
    llama = create_tiny_model(root / "llama", vocab_size=VOCAB_SIZE, hidden=32, layers=2, heads=4, kv_heads=2)
    old = create_tiny_model(root / "old", vocab_size=VOCAB_SIZE, hidden=32, layers=4, heads=4, kv_heads=2, seed=1)
    rm = create_tiny_model(root / "rm", vocab_size=VOCAB_SIZE, hidden=32, layers=2, head="seq_cls", seed=3)
    for folder in (llama, old, rm):
        create_char_tokenizer(folder)
    lora = root / "lora"  # a PEFT adapter's config, naming its base by hub id (no tokenizer of its own)
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": REPO}))
    from lora_helpers import make_peft_adapter

    init = make_peft_adapter(str(default_model_dir()), root / "init", rank=4, alpha=8, targets=["q_proj", "v_proj"])
    return {"llama": llama, "old": old, "rm": rm, "lora": lora, "init": init}


@pytest.fixture
def hub(tmp_path, monkeypatch, models):
    """The offline cache: REPO (main, and an older commit OLD with 4 layers) and RM_REPO."""
    cache = tmp_path / "hub"
    snapshots = {REPO: put_in_hub_cache(cache, REPO, models["llama"]),
                 RM_REPO: put_in_hub_cache(cache, RM_REPO, models["rm"]),
                 LORA_REPO: put_in_hub_cache(cache, LORA_REPO, models["lora"]),
                 INIT_REPO: put_in_hub_cache(cache, INIT_REPO, Path(models["init"])),
                 OLD: put_in_hub_cache(cache, REPO, models["old"], commit=OLD, main=False)}
    offline_hub(monkeypatch, cache)
    return cache, snapshots


def _ray_running() -> bool:
    import ray

    return ray.is_initialized()


# ---- resolution ---------------------------------------------------------------------------------------------
def test_every_kind_of_reference_resolves_to_a_local_folder(hub, models, tmp_path, monkeypatch):
    from hybridrl.models import load_hf_config

    cache, snapshots = hub
    assert resolve_model(REPO) == str(snapshots[REPO])
    assert resolve_model(f"{REPO}@main") == str(snapshots[REPO])
    assert resolve_model(f"{REPO}@{OLD}") == str(snapshots[OLD])
    assert load_hf_config(resolve_model(f"{REPO}@{OLD}")).num_hidden_layers == 4
    assert resolve_model(str(models["llama"])) == str(models["llama"])
    assert resolve_model(None) == resolve_model("tiny:llama") == str(default_model_dir())
    assert pinned_reference(REPO) == f"{REPO}@{commit_of(REPO)}" and pinned_reference("tiny:llama") == "tiny:llama"
    assert resolve_model(LORA_REPO) == str(snapshots[LORA_REPO])  # an adapter folder stands where a model does
    assert tokenizer_folder(snapshots[LORA_REPO]) == str(snapshots[REPO])  # its tokenizer: its base's
    assert tokenizer_folder(snapshots[RM_REPO]) == str(snapshots[RM_REPO])

    with pytest.raises(ModelReferenceError) as missing:
        resolve_model("acme/missing", "actor.model.path")
    message = str(missing.value)
    assert "\n" not in message and "actor.model.path='acme/missing'" in message and str(cache) in message
    with pytest.raises(ModelReferenceError, match="no Hugging Face model folder there, and not a hub id"):
        resolve_model(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelReferenceError, match="no config.json in .* a PEFT adapter has adapter_config.json"):
        resolve_model(str(tmp_path / "empty"))

    # HF_HOME is honoured when HF_HUB_CACHE is not set: its hub/ folder is the cache
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelReferenceError, match=str(tmp_path / "home" / "hub")):
        resolve_model(REPO)
    put_in_hub_cache(tmp_path / "home" / "hub", REPO, models["llama"])
    assert resolve_model(REPO) == str(tmp_path / "home" / "hub" / "models--acme--tiny-llama" / "snapshots" /
                                      commit_of(REPO))


def test_train_plans_hub_ids_and_refuses_an_unknown_one_before_ray(hub, capsys):
    from hybridrl.cli.train import DEFAULT_CONFIG
    from hybridrl.config import load_config
    from hybridrl.trainer.plan import plan_run

    _, snapshots = hub
    plan = plan_run(load_config(DEFAULT_CONFIG, [f"actor.model.path={REPO}", f"ref.model.path={REPO}@{OLD}",
                                                 "algorithm.name=ppo", f"critic.model.path={REPO}",
                                                 f"reward_model.model={RM_REPO}", "reward_model.tokenizer=" + REPO]))
    paths = {name: role.model_path for name, role in plan.roles.items()}
    assert paths == {"actor": str(snapshots[REPO]), "ref": str(snapshots[OLD]), "critic": str(snapshots[REPO]),
                     "reward": str(snapshots[RM_REPO])}
    assert cli_main(["train", "--check", f"actor.model.path={REPO}"]) == 0
    # a judge and a distillation teacher named by hub ids, resolved by the same plan
    judge = f'{{name: j, model: {{kind: generative, model: "{REPO}@{OLD}", template: "{{prompt}}|{{response}}="}}}}'
    plan = plan_run(load_config(DEFAULT_CONFIG, [f"actor.model.path={REPO}", f"reward.sources=[{judge}]",
                                                 f"algorithm.distill.teacher={REPO}"]))
    assert (plan.roles["reward/j"].model_path, plan.roles["teacher"].model_path) == (str(snapshots[OLD]),
                                                                                     str(snapshots[REPO]))
    assert plan.sources[0].scorer.model == str(snapshots[OLD])
    assert "config ok" in capsys.readouterr().out
    assert cli_main(["train", "--check", "reward_model.model=acme/missing", "algorithm.name=ppo"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reward_model.model='acme/missing'" in err and "HF_HUB_OFFLINE" in err
    assert cli_main(["train", "--check", f"reward_model.model={RM_REPO}", "reward_model.tokenizer=acme/missing-tok",
                     "algorithm.name=ppo"]) == 2
    assert "reward_model.tokenizer='acme/missing-tok': no local folder of that name" in capsys.readouterr().err
    assert not _ray_running()


def test_starting_adapters_may_be_a_hub_id(hub):
    """lora.init names a PEFT adapter by hub id: resolved on the driver (plan and short API alike) to the cached
    folder the workers load; an unknown id is one line naming the option."""
    from hybridrl.config import ConfigError, load_config
    from hybridrl.roles.base import checked_lora
    from hybridrl.trainer.plan import plan_run

    _, snapshots = hub
    plan = plan_run(load_config("grpo_lora_tiny", [f"actor.lora.init={INIT_REPO}", "actor.lora.rank=0",
                                                   "actor.lora.alpha=null", "actor.lora.target_modules=null"]))
    lora = plan.lora["actor"]
    assert (lora.init, lora.rank, lora.alpha, lora.target_modules) == (str(snapshots[INIT_REPO]), 4, 8.0,
                                                                        ["q_proj", "v_proj"])
    assert checked_lora({"init": INIT_REPO}, "Actor(lora=...)").init == str(snapshots[INIT_REPO])
    with pytest.raises(ConfigError) as missing:
        plan_run(load_config("grpo_lora_tiny", ["actor.lora.init=acme/missing-adapters"]))
    assert "\n" not in str(missing.value) and "actor.lora.init='acme/missing-adapters'" in str(missing.value)
    assert not _ray_running()


def test_plan_and_convert_take_hub_ids(hub, tmp_path, capsys):
    from test_plan_cli import _plan

    from hybridrl.config import load_config

    assert _plan("--model", REPO, "--train-tp", "2", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == REPO and report["train"]["tp"] == 2 and report["model_bytes"] > 0
    assert _plan("--model", "acme/missing") == 2
    assert "--model='acme/missing'" in capsys.readouterr().err
    written = tmp_path / "auto.yaml"  # --auto searches on the cached model and writes the id, not the cache path
    assert _plan("--auto", "--model", REPO, "--algorithm", "remax", "--gpus", "2", "--batch", "8", "--prompt-len",
                 "16", "--response-len", "16", "--write-config", str(written)) == 0
    assert load_config(written).actor.model.path == REPO and REPO in capsys.readouterr().out
    assert cli_main(["convert", "--from", "hf", "--to", "mcore", "acme/missing", str(tmp_path / "out")]) == 2
    assert "SRC='acme/missing': no local folder of that name, not in the Hugging Face cache" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- hybridrl submit ----------------------------------------------------------------------------------------
def _submit(capsys, *args: str) -> tuple[int, str, str]:
    from test_slurm import submit_in_process

    return submit_in_process(capsys, "configs/remax_tiny.yaml", "--nodes", "2", "--gpus-per-node", "1", *args)


def test_submit_pins_hub_revisions_and_checks_the_nodes_see_the_files(hub, tmp_path, capsys):
    cache, snapshots = hub
    rc, script, err = _submit(capsys, "--dry-run", "--model-files", "staged", f"actor.model.path={REPO}",
                              f"reward_model.model={LORA_REPO}", f"trainer.run_dir={tmp_path / 'run'}")
    assert rc == 0, err
    assert f"actor.model.path={REPO}@{commit_of(REPO)}" in script  # a requeued job reads the same commit
    assert f"reward_model.model={LORA_REPO}@{commit_of(LORA_REPO)}" in script
    rc, script, err = _submit(capsys, "--dry-run", "--model-files", "staged", f"actor.lora.init={INIT_REPO}",
                              f"algorithm.distill.teacher={REPO}")
    assert rc == 0 and f"actor.lora.init={INIT_REPO}@{commit_of(INIT_REPO)}" in script, err  # starting adapters
    assert f"algorithm.distill.teacher={REPO}@{commit_of(REPO)}" in script  # a distillation teacher
    assert f"export HF_HUB_CACHE={cache}" in script and "export HF_HUB_OFFLINE=1" in script
    # shared (the default): the cache is on this machine's own disk here, which other nodes do not see
    from hybridrl.launch.model_files import node_local_filesystem

    local = node_local_filesystem(cache)
    assert local, "the test's cache (pytest's tmp_path) should be on this machine's own disk"
    rc, _, err = _submit(capsys, "--dry-run", f"actor.model.path={REPO}")
    assert rc == 2 and f"actor.model.path: its files ({snapshots[REPO]}) are on {local}" in err
    assert "--model-files staged" in err
    rc, _, err = _submit(capsys, "--dry-run", "--ip-mode", "loopback", f"actor.model.path={REPO}")  # one host
    assert rc == 0, err
    # a dry run downloads nothing: an id missing from the cache is a note; a submission refuses it
    rc, script, err = _submit(capsys, "--dry-run", "--model-files", "staged", "actor.model.path=acme/missing")
    assert rc == 0 and "actor.model.path=acme/missing: not in the Hugging Face cache" in err
    rc, _, err = _submit(capsys, "--model-files", "staged", "actor.model.path=acme/missing")
    assert rc == 2 and "actor.model.path='acme/missing'" in err


def test_node_local_filesystems_are_told_from_shared_ones(tmp_path):
    from hybridrl.launch.model_files import node_local_filesystem

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nserver:/export /shared nfs4 rw 0 0\n"
                      "lustre@o2ib:/fs /lus lustre rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n")
    assert node_local_filesystem("/shared/hub/models--a--b", str(mounts)) is None
    assert node_local_filesystem("/lus/x", str(mounts)) is None
    assert node_local_filesystem("/sharedness/x", str(mounts)) == "ext4 at /"
    assert node_local_filesystem("/dev/shm/x", str(mounts)) == "tmpfs at /dev/shm"


def test_cluster_check_names_the_model_folders_a_node_lacks(models, tmp_path):
    """`python -m hybridrl.launch.cluster_check --models ...` (--model-files staged): each node reports the folders
    it lacks (a model has config.json, an adapter adapter_config.json)."""
    from hybridrl.launch.cluster_check import missing_model_folders

    (tmp_path / "empty").mkdir()
    folders = [str(models["llama"]), str(models["lora"]), str(tmp_path / "empty"), str(tmp_path / "nowhere")]
    assert missing_model_folders(folders) == folders[2:]


# ---- roles without a pool, parallel_config= ----------------------------------------------------------------
def test_default_pool_size(monkeypatch):
    import torch

    assert not _ray_running()  # this module starts no Ray: the size comes from the machine or the environment
    monkeypatch.setattr(resource_pool, "_default_pool", None)
    monkeypatch.delenv("HYBRIDRL_DEVICES", raising=False)
    machine = torch.cuda.device_count() if torch.cuda.is_available() else 2
    pool = ResourcePool.default()
    assert pool.world_size == machine and pool.name == "default" and ResourcePool.default() is pool
    monkeypatch.setattr(resource_pool, "_default_pool", None)
    monkeypatch.setenv("HYBRIDRL_DEVICES", "3")
    assert ResourcePool.default().world_size == 3
    assert ResourcePool.default(devices=4).world_size == 4 and ResourcePool.default().world_size == 4
    monkeypatch.setattr(resource_pool, "_default_pool", None)
    monkeypatch.setenv("HYBRIDRL_DEVICES", "two")
    with pytest.raises(ResourcePoolError, match="HYBRIDRL_DEVICES='two'"):
        ResourcePool.default()


def test_parallel_config_is_parallel_and_is_checked_before_ray(hub):
    from hybridrl.config import ParallelConfig
    from hybridrl.roles.base import parallel_argument

    assert parallel_argument(None, {"tp": 2}, "Actor") == ParallelConfig(tp=2) == parallel_argument({"tp": 2}, None,
                                                                                                      "Actor")
    with pytest.raises(ValueError, match="give parallel= or parallel_config="):
        hybridrl.Actor(model=REPO, parallel={"tp": 1}, parallel_config={"tp": 1})
    with pytest.raises(ValueError, match=r"ReferencePolicy\(parallel_config=...\): unknown keys \['tq'\]"):
        hybridrl.ReferencePolicy(model=REPO, parallel_config={"tq": 2})
    with pytest.raises(ModelReferenceError, match="RewardModel"):
        hybridrl.RewardModel(model="acme/missing", parallel_config={"tp": 1})
    with pytest.raises(ModelReferenceError, match=r"Judge\(model=...\)='acme/missing'"):
        hybridrl.Judge(model="acme/missing", template="{prompt}{response}")
    assert not _ray_running()
