"""Every flag is checked before any work: a value outside its range, NaN or infinity included, is one
UsageError line naming the flag (the trainer prints it and exits 2), never a traceback after the training
time is spent. The table of ranges (minibert/validate.py RANGES), the flags read as lists or paths, and a
fuzz test over the whole parser: any command line either validates or raises the one-line usage error."""
import dataclasses
import math
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibert.config import Config, build_parser, parse_args
from minibert.errors import UsageError
from minibert.model.bert import BertModel
from minibert.training.loss_scale import DynamicLossScaler
from minibert.training.lr_schedule import build_scheduler
from minibert.validate import RANGES, validate
from tests import launch

SHAPE = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 32,
         "--micro-batch-size", 2, "--train-iters", 10, "--lr", 1e-3]


@pytest.mark.parametrize("flags, message", [
    (["--split", "nan,1,1"], "--split 'nan,1,1'"),
    (["--split", "inf,1,1"], "--split 'inf,1,1'"),
    (["--seed", -1], "--seed -1 must be in [0, 4294967295]"),
    (["--hidden-dropout", 1.5], "--hidden-dropout 1.5 must be in [0, 1)"),
    (["--attention-dropout", 1], "--attention-dropout 1.0 must be in [0, 1)"),
    (["--make-vocab-size-divisible-by", 0], "--make-vocab-size-divisible-by 0 must be positive"),
    (["--ffn-hidden-size", -4], "--ffn-hidden-size -4 must be positive"),
    (["--ffn-hidden-size", 0], "--ffn-hidden-size 0 must be positive"),  # was silently 4 x hidden
    (["--adam-beta2", 2], "--adam-beta2 2.0 must be in [0, 1)"),
    (["--global-batch-size", 0], "--global-batch-size 0 must be positive"),  # blamed the LR warmup
    (["--global-batch-size", -8], "--global-batch-size -8 must be positive"),
    (["--weight-decay", -100], "--weight-decay -100.0 must be at least 0"),
    (["--clip-grad", -1], "--clip-grad -1.0 must be at least 0 (0 disables clipping)"),
    (["--lr", "nan"], "--lr nan must be at least 0"),
    (["--mask-prob", "inf"], "--mask-prob inf must be in [0, 1]"),
    (["--data-path", 1e308, "a", 1e308, "b"], "add up to more than a float holds"),
    (["--min-lr", 1], "--min-lr 1.0 must be at most --lr"),
    (["--fp16", "--min-loss-scale", 8, "--initial-loss-scale", 4], "--min-loss-scale 8.0 must be at most"),
])
def test_a_value_out_of_range_is_one_line_naming_the_flag(flags, message):
    assert message in launch.usage_error(SHAPE + flags, world_size=1)


def test_save_must_be_a_directory_that_can_be_written(tmp_path):
    existing = tmp_path / "a-file"
    existing.write_text("x")
    assert "is a file, not a directory" in launch.usage_error(SHAPE + ["--save", existing], world_size=1)
    assert "cannot write under" in launch.usage_error(SHAPE + ["--save", existing / "below"], world_size=1)
    cfg = validate(parse_args([str(a) for a in SHAPE + ["--save", tmp_path / "new" / "ckpt"]]), warn=None)
    assert cfg.save.endswith("ckpt")  # a folder still to create is fine


def test_every_numeric_flag_has_a_range():
    """A new numeric flag gets a range in RANGES (or is one of the flags checked by a rule of their own)."""
    import dataclasses
    numeric = {f.name for f in dataclasses.fields(Config) if f.metadata.get("help") is not None
               and (f.type in (int, float) or f.type in ("int", "float"))}
    assert numeric - set(RANGES) == set(), sorted(numeric - set(RANGES))
    assert set(RANGES) <= numeric


def flag_values():
    """For each flag of the trainer's parser: a strategy for its command-line words (possibly none)."""
    strategies = {}
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            value = st.just([flag])
        elif action.choices:
            value = st.sampled_from(list(action.choices)).map(lambda c, f=flag: [f, c])
        elif action.type is int:
            value = st.one_of(st.integers(-3, 70), st.sampled_from([0, -1, 2 ** 31, 2 ** 40])).map(
                lambda v, f=flag: [f, str(v)])
        elif action.type is float:
            value = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0])).map(
                lambda v, f=flag: [f, repr(v)])
        else:
            value = st.sampled_from(["", "x", "1,2,3", "nan,1", "0 a", "-1"]).map(lambda v, f=flag: [f, v])
        strategies[flag] = value
    return strategies


FLAGS = flag_values()


@settings(max_examples=200, deadline=None, derandomize=True, database=None,  # the same cases every run
          suppress_health_check=[HealthCheck.too_slow])
@given(chosen=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.none(), max_size=8).flatmap(
           lambda keys: st.tuples(*[FLAGS[k] for k in keys])),
       shape=st.booleans(), world_size=st.sampled_from([1, 2, 3, 4, 8]), device=st.sampled_from(["cpu", "cuda"]))
def test_any_command_line_validates_or_is_one_usage_error(chosen, shape, world_size, device):
    argv = ([str(a) for a in SHAPE] if shape else []) + [word for words in chosen for word in words]
    argv = [a for a in argv if a not in ("--load", "--use-checkpoint-args")]  # they read a checkpoint first
    try:
        cfg = validate(parse_args(argv), world_size=world_size, device_type=device, warn=None)
    except UsageError:  # the trainer prints it as one line and exits 2; any other exception fails the test
        return
    # what the run builds from the flags before its first batch takes them without an error
    if cfg.fp16:
        DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window, cfg.hysteresis)
    scheduler = build_scheduler(types.SimpleNamespace(param_groups=[{}]), cfg)
    for samples in (1, scheduler.warmup_steps, scheduler.decay_steps):
        scheduler.num_steps = samples
        assert math.isfinite(scheduler.get_lr()) and scheduler.get_lr() >= 0
    sizes = (cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.micro_batch_size, cfg.max_positions, cfg.ffn_size,
             cfg.padded_vocab_size)
    if all(size <= limit for size, limit in zip(sizes, (4, 64, 64, 4, 512, 256, 40_000))):  # a model built in ms
        small = dataclasses.replace(cfg, attention_backend="local")  # the plain ops: no kernel to interpret
        model = BertModel(small, init=False).train()  # uninitialised weights: only shapes and flags matter
        tokens = torch.zeros(cfg.micro_batch_size, cfg.seq_length, dtype=torch.long)
        with torch.no_grad():
            model(tokens, tokens, torch.zeros(tokens.shape, dtype=torch.bool))  # dropout's p, the shapes
