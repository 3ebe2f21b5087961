"""Libraries that keep the distributed model inside their own objects -- Lightning
Fabric and a Hugging Face ``Trainer`` -- written as their docs write them, train
2 ranks in step, and train again after a re-formation moved what they hold.

The re-formation comes from a mistake: rank 1 raises while rank 0 waits in a
collective.  Fabric's DDP sits in ``_FabricModule._forward_module``, the
Trainer's in ``trainer.model_wrapped`` and its accelerator's ``_models``: no
name in the namespace is a DDP, so only a walk into those objects finds them.
"""

from __future__ import annotations


from helpers.ecosystem import IN_SYNC, QUICK_S, assert_whole
from helpers.releases import raise_before_all_reduce



#: Lightning Fabric as its docs write it; each rank its own data, so equal
#: parameters after a step prove the gradients were averaged
FABRIC = """
from lightning_fabric import Fabric
fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = fabric.setup(model, optimizer)
_g = torch.Generator().manual_seed(100 + fabric.global_rank)
X, Y = torch.randn(32, 8, generator=_g), torch.randn(32, 1, generator=_g)

def fit(steps):
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(X), Y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses
"""


def _fit(c, steps: int) -> list:
    r = c.run(f"_losses = fit({steps})\n"
              "_fit = (_losses, _same(model.module[0].weight), _same(model.module[2].bias))",
              display=False)
    assert r.ok, r
    out = c.pull("_fit")
    assert out[0] == out[1]  # the mean loss is the same number on both ranks
    losses, *synced = out[0]
    assert synced == [True, True]
    assert losses[-1] < losses[0]
    return losses


def test_fabric_ddp_as_documented_trains_in_step_and_after_a_reform(c):
    pids = [r.pid for r in c.ranks]
    c.run(IN_SYNC, display=False)
    r = c.run(FABRIC + "_who = (type(fabric._connector.cluster_environment).__name__, "
              "fabric.world_size, fabric.global_rank)", display=False)
    assert r.ok, r
    # torchelastic's environment: the ranks that exist, no process started
    assert c.pull("_who") == [("TorchElasticEnvironment", 2, 0), ("TorchElasticEnvironment", 2, 1)]
    before = _fit(c, 5)
    c.run("_ids = (id(model._forward_module), id(optimizer))", display=False)
    err, took = raise_before_all_reduce(c)
    assert took < QUICK_S and err.reformed
    assert "model._forward_module: DistributedDataParallel rebuilt in place" in err.report, err.report
    after = _fit(c, 5)
    assert after[0] < before[0]  # it went on from where it was, not from scratch
    r = c.run("_same_objects = _ids == (id(model._forward_module), id(optimizer)) and "
              "model._forward_module.process_group is dist.group.WORLD", display=False)
    assert r.ok and c.pull("_same_objects") == [True, True]
    assert_whole(c, pids)


#: a Hugging Face Trainer on a GPT-2 built here (no hub), a tiny token set
TRAINER = """
import tempfile
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
torch.manual_seed(0)
lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16))

class Tokens(torch.utils.data.Dataset):
    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, max_steps=4,
                         per_device_train_batch_size=4, learning_rate=5e-3, report_to="none",
                         save_strategy="no", disable_tqdm=True, seed=0)
trainer = Trainer(model=lm, args=args, train_dataset=Tokens())
"""


def _train(c) -> float:
    r = c.run("_out = trainer.train()\n"
              "_hf = (trainer.args.world_size, _same(lm.transformer.h[0].mlp.c_fc.weight),"
              " _same(lm.lm_head.weight), round(_out.training_loss, 6))", display=False)
    assert r.ok, r
    out = c.pull("_hf")
    assert [o[:3] for o in out] == [(2, True, True)] * 2
    return out[0][3]


def test_hf_trainer_trains_and_trains_again_after_a_reform(c):
    pids = [r.pid for r in c.ranks]
    c.run(IN_SYNC, display=False)
    r = c.run(TRAINER, display=False)
    assert r.ok, r
    first = _train(c)
    err, _ = raise_before_all_reduce(c)
    assert err.reformed and "trainer.model_wrapped" in err.report, err.report
    second = _train(c)
    assert second < first  # the second run starts from the trained weights
    assert_whole(c, pids)


#: what a user's own code keeps on the group, in places no name points at directly
HELD = """
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.optim import ZeroRedundancyOptimizer
torch.manual_seed(0)
models = [DDP(torch.nn.Linear(4, 2)), DDP(torch.nn.Linear(4, 2))]

class Wrapped:  # an optimizer wrapper, as schedulers and libraries write them
    def __init__(self, opt):
        self.optimizer = opt
    def step(self):
        self.optimizer.step()
    def zero_grad(self):
        self.optimizer.zero_grad()
    def __getattr__(self, name):  # must not be asked anything by the walk
        raise RuntimeError(f"the walk asked for {name}")

class Comm:
    def __init__(self):
        self.pg = dist.group.WORLD
    @property
    def busy(self):  # must not be read by the walk
        raise RuntimeError("the walk read a property")

opts = {"zero": Wrapped(ZeroRedundancyOptimizer(models[0].parameters(),
                                                 optimizer_class=torch.optim.SGD, lr=0.1))}
comm = Comm()
sub = dist.new_group()
frozen = (dist.group.WORLD,)
_g = torch.Generator().manual_seed(rank)
X = torch.randn(8, 4, generator=_g)

def held_step():
    for m in models:
        m(X).sum().backward()
    opts["zero"].step(); opts["zero"].zero_grad()
    t = torch.ones(1)
    dist.all_reduce(t, group=comm.pg)
    return _same(models[0].module.weight) and _same(models[1].module.weight) and t.item() == 2
"""


def test_a_reform_moves_what_user_objects_hold_and_says_what_it_could_not(c):
    pids = [r.pid for r in c.ranks]
    c.run(IN_SYNC, display=False)
    assert c.run(HELD + "_ok = held_step()", display=False).ok and c.pull("_ok") == [True] * 2
    c.run("_ids = [id(m) for m in models]", display=False)
    msg = c.reform()["message"]  # %dp reform: the same walk, the same report
    for line in ("models[0]: DistributedDataParallel rebuilt in place (same object)",
                 "models[1]: DistributedDataParallel rebuilt in place",
                 "opts['zero'].optimizer: ZeroRedundancyOptimizer pointed at the new group",
                 "comm.pg: the new group", "Not moved: ",
                 "sub: built on a group of your own", "frozen[0]: the old group, in a tuple"):
        assert line in msg, msg
    r = c.run("_ok = (held_step(), _ids == [id(m) for m in models])", display=False)
    assert r.ok and c.pull("_ok") == [(True, True)] * 2
    c.run("del sub, frozen", display=False)
    assert_whole(c, pids)
