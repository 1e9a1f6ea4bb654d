"""Typed configuration: one dataclass per config group option, registered in Hydra's ConfigStore.

Each YAML file under configs/<group>/ starts from one of these schemas, so OmegaConf rejects an
unknown key or a value of the wrong type while composing, naming the key. Checks that types cannot
express (ranges, combinations) live in `validate`, which runs before anything is built.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A bad configuration value, reported as one line before any training starts."""


class Choice(str, Enum):
    """A setting with a fixed set of names: OmegaConf rejects any other while composing. It
    compares equal to its name and prints as it."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # type: ignore[assignment]  # str's on purpose, which the Enum stub's signature rejects


class Task(Choice):
    classification = "classification"
    detection = "detection"
    translation = "translation"
    language_model = "language_model"
    causal_lm = "causal_lm"
    gan = "gan"


class DType(Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Update(Enum):
    # The optimizer named in optim.name, run on FP32 tensors (the weights, or the master copy).
    optimizer = "optimizer"
    # NVCaffe's FP16 solver: v = m*v - lr*g; w += v, with v and w stored in FP16.
    fp16_classic_momentum = "fp16_classic_momentum"
    # Naruse's modified momentum: G = m*G + g; w -= lr*G, with G and w stored in FP16.
    fp16_modified_momentum = "fp16_modified_momentum"


@dataclass
class LookaheadConfig:
    """Jordan 2024's lookahead averaging (precision/lookahead.py): from epoch `start_epoch` on, at
    every `every`-th step, a running average ema += (1 - rho) * (w - ema), rho = decay_base^every *
    (step / total steps)^decay_pow, replaces the weights; at each epoch's end the weights become it.
    start_epoch null: no averaging."""

    start_epoch: Optional[int] = None
    every: int = 5
    decay_base: float = 0.95
    decay_pow: float = 3.0


@dataclass
class PaperRecipe:
    """The published training recipe of a model (used by schedule=paper and as optimizer defaults)."""

    batch_size: int = 256
    optimizer: str = "sgd"
    lr: float = 0.1  # at a batch of lr_batch samples; scaled linearly with the batch size
    lr_batch: Optional[int] = 256  # null: lr is used as given at any batch size (Adam recipes)
    momentum: float = 0.9
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adam
    weight_decay: float = 1e-4
    epochs: Optional[float] = 90  # the length in epochs, or
    steps: Optional[int] = None  # in iterations (SSD's recipe is counted in iterations)
    lr_milestones: list[float] = field(default_factory=lambda: [30.0, 60.0])  # in the unit of the length
    lr_gamma: float = 0.1
    warmup_steps: int = 0  # GNMT's exponential warm-up from 1% of the lr
    lr_shape: str = "step"  # step: milestones | triangle: Jordan 2024's (ScheduleConfig.lr_triangle)
    lr_triangle: list[float] = field(default_factory=lambda: [0.2, 0.23, 0.07])
    clip_grad_norm: Optional[float] = None
    initial_accumulator: float = 0.0  # adagrad
    nesterov: bool = False  # sgd
    norm_bias_lr_scale: float = 1.0  # OptimConfig's
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    source: str = ""


@dataclass
class ShortRun:
    """The size of this model's schedule=short: minutes on 2 CPU cores. Models differ 100x in cost
    per sample, so each says how much of it fits."""

    batch_size: int = 8
    steps: int = 24
    lr_milestones: list[float] = field(default_factory=list)  # in steps
    eval_every: int = 12


@dataclass
class ModelConfig:
    name: str = MISSING
    task: Task = Task.classification
    arch: str = MISSING  # torchvision builder name, or the architecture's own name
    input_size: Optional[int] = (
        224  # the paper's resolution (schedule=paper and bench); null: the model takes no images
    )
    small_input_size: Optional[int] = 32  # smallest size the architecture accepts (schedule=short and smoke)
    static_scale: float = 1000.0  # default of scale=static for this model
    static_scale_source: str = ""
    aux_loss_weight: float = 0.0  # auxiliary classifier heads (GoogLeNet, Inception v3)
    dropout: Optional[float] = (
        None  # classifiers with dropout (AlexNet, VGG, GoogLeNet, Inception v3): its rate; null: torchvision's
    )
    backbone_weights: Optional[str] = (
        None  # detection: a local torchvision vgg16 state dict to start from (null: random init)
    )
    input_convention: str = (
        "unit_variance"  # detection: unit_variance ([0,1], ImageNet mean/std) | caffe (0-255 minus the mean pixel)
    )
    # Classifiers: the loss's label smoothing and reduction over the batch (mean | sum), and the
    # test-time augmentation of each evaluation (0: none, 1: the mirror image too, 2: and the image
    # translated by one pixel up-left and down-right, Jordan 2024's levels).
    label_smoothing: float = 0.0
    loss_reduction: str = "mean"
    tta: int = 0
    whiten_bias_epochs: Optional[int] = None  # airbench94: epochs its whitening layer's bias trains (null: all)
    # A classifier from outside the zoo (models/builders.py): a user's function (`package.module:function`
    # or `path/to/file.py:function`), or a library's model by name (library: timm); kwargs go to either.
    builder: Optional[str] = None
    library: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    recipe: PaperRecipe = field(default_factory=PaperRecipe)
    short: ShortRun = field(default_factory=ShortRun)


@dataclass
class TranslationModelConfig(ModelConfig):
    """GNMT-style encoder-decoder (models/gnmt.py). Defaults: NVIDIA's GNMT v2."""

    hidden_size: int = 1024  # LSTM units per direction, embedding size, attention units
    encoder_layers: int = 4
    encoder_bidirectional_layers: int = 1  # the first layers are bidirectional, the rest unidirectional
    decoder_layers: int = 4  # the first one feeds the attention
    dropout: float = 0.2
    label_smoothing: float = 0.1
    loss_reduction: str = "mean"  # mean: over target tokens | sum: over time steps, mean over sentences
    init_weight: float = 0.1  # every weight starts uniform in [-init_weight, init_weight]
    beam_size: int = 5  # 1: greedy decoding
    len_norm_factor: float = 0.6  # GNMT's length penalty ((c + |Y|) / (c + 1))^factor
    len_norm_const: float = 5.0
    max_decode_len: int = 150  # tokens, also capped at 2 x source length + 10
    pad_to_multiple: int = 8  # vocabulary and sequence lengths, for tensor cores


@dataclass
class LanguageModelConfig(ModelConfig):
    """bigLSTM (models/biglstm.py): LSTM layers with projections, sampled softmax. Defaults: the paper's."""

    hidden_size: int = 8192  # LSTM cells per layer
    proj_size: int = 1024  # each layer's output projection; also the embedding size
    layers: int = 2
    dropout: float = 0.1
    num_sampled: int = 8192  # negatives per step, log-uniform over frequency-ranked ids
    bptt: int = 20  # time steps per batch; the state carries over from one batch to the next
    # The sampled softmax's true-word logit: "dot", an elementwise product and sum as TensorFlow's
    # sampled_softmax_loss computes it (outside any matrix product, so FP8 and MX modes leave it
    # unquantized while the sampled logits are); "product", a batched product of its own, which
    # those modes quantize as they do the sampled logits' (and autocast modes run in their dtype,
    # where the dot product stays FP32).
    true_logit: str = "dot"
    # How validation and test are scored. "carried": the split as one stream cut into batch_size rows,
    # the state carried from zeros across the windows (f-lm's and Zaremba et al.'s evaluation).
    # "sentence": each sentence from a zero state, so a cell that latches (its cell state growing
    # by about 1 a word without bound, which some weights do on some streams) harms one sentence,
    # not the rest of a row. docs/tasks-and-data.md, "Language-model evaluation".
    eval_state: str = "carried"


@dataclass
class CausalLMConfig(ModelConfig):
    """Decoder language models on a corpus's windows, full softmax (models/causal_lm.py): GPT-2's
    architecture (arch gpt), a user's builder (custom) or a HuggingFace causal LM (hf)."""

    n_layer: int = 12  # gpt: GPT-2 small's 12 blocks of 12 heads, 768 wide
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bptt: int = 1024  # tokens per window: the context; each window is scored on its own
    eval_state: str = "carried"  # how the splits are cut: as one stream (carried) or a sentence a row
    path: Optional[str] = None  # hf: a local folder holding config.json (and weights, for pretrained)
    hf_config: dict[str, Any] = field(default_factory=dict)  # hf: model_type and settings, or overrides of path's
    pretrained: bool = False  # hf: the folder's weights (its vocabulary must be the corpus's)


@dataclass
class GANModelConfig(ModelConfig):
    """DCGAN (models/dcgan.py): a generator and a discriminator. Defaults: the paper's 128x128 network."""

    nz: int = 100  # latent size
    ngf: int = 64  # generator width: its layers have ngf times 16, 8, 4, 2, 1 (and 1) channels
    ndf: int = 64  # discriminator width: ndf times 1, 2, 4, 8, 16 (and 16) channels
    d_fc_size: int = 1024  # dcgan128: the discriminator's hidden fully connected layer
    leaky_slope: float = 0.2
    init_std: float = 0.02  # Radford et al.: every weight from N(0, 0.02), batch-norm scales from N(1, 0.02)
    sample_grid: int = 64  # fixed-noise samples in each evaluation's grid (a square number looks best)
    fid_weights: Optional[str] = (
        None  # a local Inception weights file; null: FID is not computed (nothing is downloaded)
    )
    fid_samples: int = 10000  # generated images per FID (against at most this many real ones)


@dataclass
class ProductsConfig:
    """The operands of matrix products in a narrower format (precision/quantized_products.py, product_operands.py)."""

    # format of the forward's inputs and weights (a name in formats.FORMATS); null: products as the
    # mode computes them
    forward: Optional[str] = None
    backward: Optional[str] = None  # format of the gradients flowing back into a product
    # tensor: each operand's own amax; delayed: an amax history (Transformer Engine); block: MX block scales
    scaling: str = "tensor"
    amax_history: int = 1024  # delayed: steps of amax kept (Transformer Engine's default)
    margin: int = 0  # delayed: powers of two of headroom below the format's largest value
    amax_reduction: str = "max"  # delayed: max over the history, or most_recent
    # An LSTM's cell (its gates' elementwise work, forward and backward) compiled into fused
    # kernels by this torch.compile backend (inductor), one piece per time step; null: eager
    fused_cell: Optional[str] = None


@dataclass
class PrecisionConfig:
    """Where each number lives. The engine is built from these fields alone, never from `name`."""

    name: str = MISSING
    param_dtype: DType = DType.float32  # dtype the model's weights and gradients are stored in
    master_weights: bool = False  # an FP32 copy of the weights that the optimizer updates
    norm_fp32: bool = False  # batch-norm parameters and statistics stay FP32
    autocast: Optional[DType] = None  # torch.autocast dtype for the forward pass
    update_rule: Update = Update.optimizer
    tf32: bool = False  # TF32 tensor-core math for FP32 matmuls and convolutions (CUDA only)
    products: ProductsConfig = field(default_factory=ProductsConfig)
    allreduce_dtype: Optional[DType] = (
        None  # under torchrun: the dtype gradients are all-reduced in (null: their own; FP16 for mixed)
    )
    label: str = ""  # how tables name the mode


@dataclass
class ScaleConfig:
    """Loss scaling. `none`: S = 1 and no overflow check. `static`: fixed S. `dynamic`: GradScaler's
    rule. `auto`: S from running statistics of log2 max|g| (scaler.AutoScaler)."""

    name: str = MISSING
    value: Optional[float] = None  # static: S (null: the model's static_scale)
    # static: this many skipped steps in a row end the run as diverged: a scale that overflows every
    # step would otherwise spend the whole schedule training nothing, and end `ok`
    max_consecutive_skips: int = 100
    # static: this many skipped steps in a row warn once, before the run goes on to the limit above (a
    # limit at or below it ends the run first, its message saying what the warning would)
    warn_consecutive_skips: int = 20
    init: float = 2.0**16  # dynamic, auto: starting scale
    interval: int = 2000  # dynamic: clean steps before growing
    growth: float = 2.0
    backoff: float = 0.5
    min: float = 1.0  # dynamic, auto: an overflow at this scale ends the run as diverged
    max: float = 2.0**24
    beta1: float = 0.99  # auto: decay of the running mean of log2 max|g|
    beta2: float = 0.999  # auto: decay of the slower mean and second moment that give its spread
    std_devs: float = 3.09  # auto: standard deviations of headroom (OpenSeq2Seq's; 99.9% of a normal)
    margin_bits: float = 1.0  # auto: powers of two of headroom on top
    # A control for loss scaling, with any strategy: k multiplies the loss by 2^-k before the
    # backward and the gradients by 2^k before the update. Exact in FP32 while the shifted gradients
    # stay normal FP32 numbers (the run is the same bit for bit); in FP16 it pushes the gradients
    # down into and past FP16's subnormals.
    shift_down: int = 0
    # static, dynamic: keep the scale, the overflow flag and the LR schedule's position on the device,
    # so that no step waits for the host (precision/resident_scale.py). null: on a GPU, wherever the
    # run allows it (a fused torch optimizer, no lookahead); true: required; false: the host path.
    on_device: Optional[bool] = None


@dataclass
class DataConfig:
    """What every data source has. Each source's schema below adds its own settings only, so a
    setting of another source is an unknown key for this one (data=voc data.vocab_size=8 fails)."""

    name: str = MISSING


@dataclass
class SyntheticDataConfig(DataConfig):
    """Data made on the run's device, no files and no loader: one generator per task."""

    train_samples: int = 512
    val_samples: int = 128
    # classification: class templates plus noise
    num_classes: int = 10
    noise: float = 0.5
    # detection: coloured shapes (num_classes kinds) on noisy backgrounds; gan: soft-edged discs
    max_objects: int = 3
    pixel_noise: float = 0.1  # std of the Gaussian noise on [0, 1] pixels
    # translation: a deterministic word mapping with local reordering; language_model: sentences of a
    # random Markov source over vocab_size words
    vocab_size: int = 32
    min_len: int = 3  # translation: shortest sentence (words)
    max_len: int = 12  # translation: longest sentence (words)
    num_buckets: int = 5  # translation: length buckets; a batch draws its pairs from one
    sentence_end_prob: float = 0.1  # language_model: the chance a sentence ends after each word


@dataclass
class FileDataConfig(DataConfig):
    """Data read from files under `root` by loader processes."""

    root: Optional[str] = None
    num_workers: int = -1  # -1: the CPUs this process was given, less one (sampling.default_workers)


@dataclass
class ImageFolderDataConfig(FileDataConfig):
    """root/<train_split>/<class>/* and root/<val_split>/<class>/*."""

    train_split: str = "train"
    val_split: str = "val"
    resize_ratio: float = 256 / 224  # validation: Resize(image_size * ratio) then CenterCrop(image_size)
    # training augmentation: imagenet (RandomResizedCrop and flip, the ImageNet recipes') | cifar
    # (4 pixels of zero padding, a random crop of image_size and flip, He et al. 2016's CIFAR recipe)
    # | airbench (2 reflected pixels, a random crop and alternating flips, Jordan 2024's)
    augment: str = "imagenet"
    # true: both splits decoded once into uint8 tensors on the device, each batch augmented there
    # (cifar or airbench; datasets/resident_images.py): CIFAR-sized data at a GPU's pace, no workers
    resident: bool = False
    cache_dir: Optional[str] = ".data/cache"  # where a resident source caches the decoded splits; null: no cache
    # where the images are decoded: host (PIL in the loader's workers) | device (the JPEGs' bytes read by
    # the workers and decoded on the run's device, nvJPEG on a GPU; augment imagenet; datasets/device_decode.py)
    decode: str = "host"
    # decode every image of both splits before training and name each one that cannot be read (a file a
    # batch would meet mid-run); null: on schedule=smoke only, whose runs are checks of a set-up
    verify: Optional[bool] = None
    # a resident source's evaluation batch (null: schedule.batch_size): evaluation keeps no activations
    # for a backward, so a GPU fits a larger one (airbench evaluates 2,000 at a time)
    eval_batch_size: Optional[int] = None


@dataclass
class VOCDataConfig(FileDataConfig):
    """A VOCdevkit folder, or a flat annotations/ + images/ pair (datasets/voc.py)."""

    # sets to train and evaluate on ("VOC2007/trainval" in a devkit, or a split file of a flat folder)
    train_sets: list[str] = field(default_factory=list)
    val_sets: list[str] = field(default_factory=list)
    class_names: list[str] = field(default_factory=list)
    keep_difficult: bool = True  # train on objects marked difficult too, as SSD did (evaluation always ignores them)
    # a box reaching outside its image: false stops the run naming it; true clips it to the image
    # (dropping it if nothing is inside) and counts both in the record (data.clipped_boxes, data.dropped_boxes)
    clip_boxes: bool = False


@dataclass
class ParallelTextDataConfig(FileDataConfig):
    """root/<split>.<lang>[.gz], one sentence per line."""

    src_lang: str = "en"
    tgt_lang: str = "de"
    train_split: str = "train"
    val_split: str = "val"
    test_split: Optional[str] = None  # scored once at the end of the run (metrics test_*)
    vocab_size: int = 32000  # subword vocabulary of the trained tokenizer, both languages together
    max_len: int = 50  # longest training pair kept (subwords)
    num_buckets: int = 5  # length buckets: a batch draws its pairs from one bucket
    tokenizer_model: Optional[str] = None  # a sentencepiece .model to use (null: train one on the training text)
    tokenizer_sentences: int = 1_000_000  # sentences sampled to train the tokenizer


@dataclass
class TextCorpusDataConfig(FileDataConfig):
    """File globs under root (train_split, val_split, test_split), one tokenized sentence per line."""

    train_split: str = MISSING
    val_split: str = MISSING
    test_split: Optional[str] = None  # scored once at the end of the run (metrics test_*)
    min_count: int = 1  # words seen fewer times in training become <unk>
    max_vocab: Optional[int] = None  # keep at most this many ids (the most frequent)
    vocab_file: Optional[str] = None  # one token per line, most frequent first (instead of counting)


@dataclass
class ImageDirDataConfig(FileDataConfig):
    """Every image under root, any depth (GANs)."""

    crop: Optional[int] = (
        None  # center-crop side in pixels before resizing to the model's size (null: the shorter side)
    )
    val_samples: int = 1000  # reference images for D(x) and FID: a seeded sample of the folder


# Each data source's schema, by data.name (configs/data/<name>.yaml starts from schema/data_<name>).
DATA_SCHEMAS = {
    "synthetic": SyntheticDataConfig,
    "imagefolder": ImageFolderDataConfig,
    "voc": VOCDataConfig,
    "parallel_text": ParallelTextDataConfig,
    "text_corpus": TextCorpusDataConfig,
    "image_dir": ImageDirDataConfig,
}


@dataclass
class ScheduleConfig:
    name: str = MISSING
    batch_size: int = MISSING
    steps: Optional[int] = None  # length in optimizer steps, or
    epochs: Optional[float] = None  # in passes over the training data
    lr_milestones: list[float] = field(default_factory=list)  # in the unit of the length (epochs or steps)
    lr_gamma: float = 0.1
    lr_warmup_steps: int = 0  # exponential warm-up from 1% of the lr (GNMT's)
    # step: the lr falls by lr_gamma at each milestone | triangle: the lr's multiple runs linearly
    # from lr_triangle[0] to 1 at the share lr_triangle[1] of the run, then to lr_triangle[2] at its end
    lr_shape: str = "step"
    lr_triangle: list[float] = field(default_factory=lambda: [0.2, 0.23, 0.07])
    image_size: Optional[int] = MISSING  # null for models that take no images
    eval_every: Optional[int] = None  # steps between evaluations; null: once per epoch with epochs, else at the end
    eval_batches: Optional[int] = None  # cap on validation batches per evaluation
    checkpoint_every: Optional[int] = None  # steps between checkpoints (null: only at the end)
    log_every: int = 10  # steps between flushes of the per-step log (the only host syncs besides overflow checks)
    throughput_warmup: int = 5  # steps excluded from throughput
    throughput_window: int = 5  # steps per timing window; throughput is the median over windows
    count_flops: bool = False  # count model FLOPs on the process's first step, for MFU (runner/instruments/flops.py)


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adam | adagrad
    lr: float = 0.1  # at a batch of lr_batch samples
    lr_batch: Optional[int] = 256  # lr scales linearly with schedule.batch_size / lr_batch; null: used as given
    momentum: float = 0.9  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adam
    eps: float = 1e-8  # adam, adagrad
    initial_accumulator: float = 0.0  # adagrad
    weight_decay: float = 1e-4
    clip_grad_norm: Optional[float] = None  # applied to unscaled gradients
    nesterov: bool = False  # sgd on torch's optimizer
    # The lr of batch-norm biases, times this (Jordan 2024's 64); their weight decay per step stays
    # the other weights' (torch's weight_decay for them divided by it)
    norm_bias_lr_scale: float = 1.0
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    # torch's optimizers (every mode but fp16/fp16_modmom, whose FP16 update is this project's):
    # default (torch's choice: foreach on CUDA) | for_loop | foreach | fused (one kernel per step)
    implementation: str = "default"


@dataclass
class StatsConfig:
    """Gradient statistics (runner/instruments/grad_stats.py): histograms of log2|g| of activation gradients
    (each parameterized layer's output) and weight gradients, per layer and in total; the weight
    updates FP16 weights lose; and the numerics atlas of the formats listed."""

    grad_hist: bool = False  # on: sample every `every`-th step; off: no hook is ever installed
    # on: on the same sampled steps, count the updates FP16 weights lose or would lose (precision/lost_updates.py)
    lost_updates: bool = False
    every: int = 100  # the every-th, 2*every-th, ... step is sampled (1: every step)
    keep: float = 0.999  # the share of non-zero gradients the recommended scale keeps from FP16's zero
    # The numerics atlas: on the same sampled steps, every matrix product's inputs, weights,
    # activation gradients and weight gradients against each of these formats (precision/formats.py)
    formats: list[str] = field(default_factory=list)
    # On a skipped step, run it again with hooks to name the first module whose tensor became
    # non-finite (runner/instruments/overflow_trace.py); steps that do not overflow pay nothing for it
    trace_overflow: bool = True


@dataclass
class CompileConfig:
    """torch.compile of each network the task trains through; the optimizer step stays eager."""

    backend: Optional[str] = (
        None  # inductor (torch's own), or any name torch._dynamo.list_backends() gives; null: eager
    )
    mode: Optional[str] = (
        None  # inductor's: default | reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs
    )


@dataclass
class DistributedConfig:
    """Settings that matter only under torchrun (distributed.py)."""

    sync_batchnorm: bool = False  # batch-norm statistics over the global batch (torch's SyncBatchNorm: CUDA only)
    # Each gradient a view into DDP's all-reduce bucket, as the references of torchvision and NVIDIA's
    # DeepLearningExamples set it: one copy of the gradients fewer, none into the buckets at each backward.
    gradient_as_bucket_view: bool = True
    # DDP's default sends rank 0's buffers (batch-norm running statistics) to every rank before each
    # forward. They matter only to evaluation and checkpoints, which use rank 0's: evaluation sends
    # them once, before it scores (data_parallel.before_evaluation), so the per-step broadcast is off.
    broadcast_buffers: bool = False
    # DDP's static_graph: the same parameters take part in every step, one forward per backward
    # (not DCGAN, whose discriminator runs twice per step).
    static_graph: bool = False


class Verdict(Choice):
    """What a comparison can conclude (report/comparisons.py), and what a paper claims."""

    equivalent = "equivalent"  # the whole interval of the paired difference lies within +-margin
    worse = "worse"  # the whole interval lies beyond zero, on the worse side
    better = "better"
    inconclusive = "inconclusive"


@dataclass
class ComparisonConfig:
    """One comparison an experiment will make: every cell whose settings match `cell` against the
    cell that `against`'s settings make of it, everything else equal, paired by seed. Keys are group
    choices (`precision`, `scale`, `model`, ...) or dotted config paths (`precision.norm_fp32`)."""

    cell: dict[str, Any] = field(default_factory=dict)
    against: dict[str, Any] = field(default_factory=dict)
    expect: Optional[Verdict] = None  # what the paper claims the comparison shows (null: no claim, a measurement)
    claim: str = ""  # the paper's words, with where they are


@dataclass
class ExperimentConfig:
    """What an experiment preset declares before its runs (configs/experiment/): the metric its
    verdicts use and the margin within which two cells count as equivalent. Each run's record keeps
    it, so a report can show that the margin predates the runs. It changes no computation."""

    name: str = MISSING
    metric: str = MISSING  # a key of the task's evaluation (top1, test_bleu, test_perplexity, ...)
    margin: float = MISSING  # in the metric's units (a fraction for top1), or
    relative: bool = False  # as a fraction of the baseline cell's mean (perplexity's 2%)
    # whether a larger metric is better; null: the task's own direction for its metric and test_<metric>,
    # lower for a *loss or *ppl
    higher_is_better: Optional[bool] = None
    # FP32 reaches its plateau under this recipe, as measured (the preset's header says where):
    # only a converged experiment's verdicts say "reproduced" or "contradicted"
    converged: bool = False
    # the seeds its sweeps run, each a planned pair of every comparison: until all have finished, a
    # comparison draws no finding (incomplete), and a run of another seed is refused. null: the pairs
    # that finished, as a declaration made before the field has it
    seeds: Optional[list[int]] = None
    comparisons: list[ComparisonConfig] = field(default_factory=list)
    # what the runs' measurement is known to lack, found after them (a declaration file's, mostly):
    # the comparisons table prints it under its rows, and draws no finding from their verdicts
    caveat: Optional[str] = None


@dataclass
class WandbConfig:
    """logger=wandb (runner/wandb_log.py): offline by default, the run kept under its folder's wandb/."""

    project: str = "mpt"
    entity: Optional[str] = None
    mode: str = "offline"  # offline | online | disabled


@dataclass
class Config:
    model: ModelConfig = MISSING
    precision: PrecisionConfig = MISSING
    scale: ScaleConfig = MISSING
    data: DataConfig = MISSING
    schedule: ScheduleConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    experiment: Optional[ExperimentConfig] = None  # set by an experiment preset: its declared comparisons
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    channels_last: Optional[bool] = None  # null: on for convolutional models on CUDA, and for FP16 weights on CPU
    cudnn_benchmark: bool = True
    # On a CPU, the FP16 and BF16 matrix products and convolutions of training (weights or autocast)
    # as a GPU's tensor cores compute them: FP32 accumulation of the rounded inputs, one rounding, at
    # the speed of FP32 kernels (precision/cpu_tensor_cores.py). false: torch's own CPU kernels.
    emulate_tensor_cores: bool = True
    # With it, an FP16 or BF16 LSTM's gate products (the input's and the recurrent state's) are each
    # rounded to the dtype before the FP32 sums, as one step of an H100's cuDNN LSTM computes
    # (results/gpu-h100-loan3/arithmetic). false: the sums of unrounded products, the emulation
    # before commit 7fba77d, for comparing the two.
    emulate_lstm_gate_rounding: bool = True
    deterministic: bool = False
    force: bool = False  # run even if the run folder already holds a record with status ok
    resume: bool = True  # continue from the run folder's checkpoint when there is one
    # write checkpoints (every schedule.checkpoint_every steps and at the end); null: all but a smoke run
    # that sets no checkpoint_every, whose few steps check a set-up and whose checkpoint nobody resumes
    # (570 MB for AlexNet)
    checkpoint: Optional[bool] = None
    # tensorboard: event files in the run's folder beside metrics.jsonl (runner/tensorboard_log.py) | csv |
    # wandb | none
    logger: Optional[str] = "tensorboard"
    wandb: WandbConfig = field(default_factory=WandbConfig)


def checkpointing(cfg: DictConfig) -> bool:
    """Whether the run writes checkpoints: `checkpoint`, or where null, whether it is not a smoke run
    or asks for them (`schedule.checkpoint_every`)."""
    if cfg.checkpoint is not None:
        return bool(cfg.checkpoint)
    return cfg.schedule.name != "smoke" or cfg.schedule.get("checkpoint_every") is not None


def _pow2(exponent: float, plus: float = 0) -> float:
    """2^(exponent + plus): for a preset whose setting follows another (a dynamic scaler's range that
    follows scale.shift_down, `${mpt_pow2:${scale.shift_down},16}`)."""
    return 2.0 ** (float(exponent) + float(plus))


def _builder_name(spec: str) -> str:
    """model=custom's name: its builder function's (`package.module:function` -> `function`)."""
    return str(spec).rpartition(":")[2] or "custom"


if not OmegaConf.has_resolver("mpt_pow2"):
    OmegaConf.register_new_resolver("mpt_pow2", _pow2)
if not OmegaConf.has_resolver("mpt_builder_name"):
    OmegaConf.register_new_resolver("mpt_builder_name", _builder_name)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, node in [
        ("model", ModelConfig),
        ("model_translation", TranslationModelConfig),
        ("model_language", LanguageModelConfig),
        ("model_causal_lm", CausalLMConfig),
        ("model_gan", GANModelConfig),
        ("precision", PrecisionConfig),
        ("scale", ScaleConfig),
        ("data", DataConfig),
        *((f"data_{name}", schema) for name, schema in DATA_SCHEMAS.items()),
        ("schedule", ScheduleConfig),
    ]:
        # Kept out of the option groups themselves, so "Available options" lists only real choices.
        cs.store(group="schema", name=group, node=node)


GROUPS = ("model", "precision", "scale", "data", "schedule")  # the config groups that make a run's choices
SCALE_NAMES = ("none", "static", "dynamic", "auto")
# Checked in validate, not typed as Choice: a bad value is then a ConfigError naming it, from the
# command line and from a composed config alike (compile.mode's names are not identifiers anyway).
OPTIMIZERS = ("sgd", "adam", "adagrad")
OPTIM_IMPLEMENTATIONS = ("default", "for_loop", "foreach", "fused")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def positive(cfg: DictConfig, key: str, allow_none: bool = False) -> None:
    """`key` holds a finite number above zero (or None, where allowed)."""
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return
    if value is None or not (value > 0) or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{key}={value}: must be a positive number")


LR_SHAPES = ("step", "triangle")


def validate_schedule_shape(schedule: DictConfig) -> None:
    if schedule.lr_shape not in LR_SHAPES:
        raise ConfigError(f"schedule.lr_shape={schedule.lr_shape}: expected one of {', '.join(LR_SHAPES)}")
    if schedule.lr_shape == "triangle":
        tri = list(schedule.lr_triangle)
        if len(tri) != 3 or not (tri[0] >= 0 and tri[2] >= 0 and 0 < tri[1] < 1):
            raise ConfigError(
                f"schedule.lr_triangle={tri}: expected [start multiple >= 0, peak's share of the run in (0, 1), "
                "end multiple >= 0]"
            )
        if schedule.lr_milestones or schedule.lr_warmup_steps:
            raise ConfigError(
                "schedule.lr_shape=triangle: the triangle is the whole schedule; "
                "set schedule.lr_milestones=[] and schedule.lr_warmup_steps=0"
            )


def validate_update_extras(cfg: DictConfig) -> None:
    """Nesterov momentum, the batch-norm biases' lr multiple and lookahead (Jordan 2024's recipe)."""
    o = cfg.optim
    if o.nesterov and (o.name != "sgd" or o.momentum <= 0):
        raise ConfigError(
            f"optim.nesterov=true: needs optim.name=sgd with momentum > 0 (got {o.name}, momentum {o.momentum})"
        )
    if not (o.norm_bias_lr_scale > 0 and math.isfinite(o.norm_bias_lr_scale)):
        raise ConfigError(f"optim.norm_bias_lr_scale={o.norm_bias_lr_scale}: must be a positive number")
    la = o.lookahead
    if la.start_epoch is not None and not (
        la.start_epoch >= 0 and la.every >= 1 and 0 < la.decay_base <= 1 and la.decay_pow >= 0
    ):
        raise ConfigError(
            f"optim.lookahead={OmegaConf.to_container(la)}: "
            "need start_epoch >= 0, every >= 1, decay_base in (0, 1] and decay_pow >= 0"
        )


LOGGERS = ("tensorboard", "csv", "wandb", "none")
WANDB_MODES = ("offline", "online", "disabled")
MAX_SHIFT_DOWN = 126
MAX_SEED = 2**32 - 1


# What the model options that name no model (custom, timm, torchvision) need from the command line.
MODEL_REQUIRES = {
    "builder": "<package.module:function or path/to/file.py:function>",
    "name": "<a timm model> (timm.list_models() lists them)",
    "arch": "<a torchvision classifier> (torchvision.models.list_models() lists them)",
}


def validate(cfg: DictConfig) -> None:
    """Range and combination checks of the settings every run has, run before anything is built.
    Raises ConfigError naming the key. Each task and data source checks its own settings beside its
    builder (models.validate, datasets.validate)."""
    for key in cfg.model:
        if OmegaConf.is_missing(cfg.model, key):  # an option that leaves it to the command line (model=custom)
            needed = MODEL_REQUIRES.get(key, "<value>")
            raise ConfigError(f"model.{key}: not given; this model needs model.{key}={needed}")
    if not 0 <= cfg.seed <= MAX_SEED:  # an int: the schema types it
        # the run seeds random, numpy and torch with it; numpy's is the narrowest range of the three
        raise ConfigError(f"seed={cfg.seed}: must be an integer from 0 to 2**32 - 1 = {MAX_SEED} (numpy's seed range)")
    for key in ["schedule.batch_size", "schedule.log_every", "schedule.throughput_window", "optim.lr", "optim.eps"]:
        positive(cfg, key)
    for key in [
        "schedule.steps",
        "schedule.epochs",
        "schedule.eval_every",
        "schedule.eval_batches",
        "schedule.checkpoint_every",
        "optim.clip_grad_norm",
        "optim.lr_batch",
    ]:
        positive(cfg, key, allow_none=True)
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas={list(cfg.optim.betas)}: expected two numbers in [0, 1)")
    for key in [
        "optim.momentum",
        "optim.weight_decay",
        "optim.initial_accumulator",
        "schedule.throughput_warmup",
        "schedule.lr_warmup_steps",
    ]:
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)}: must be zero or positive")
    if cfg.logger not in (*LOGGERS, None):
        raise ConfigError(f"logger={cfg.logger}: expected one of {', '.join(LOGGERS)}")
    if cfg.wandb.mode not in WANDB_MODES:  # a bad setting is named whether or not the package is there
        raise ConfigError(f"wandb.mode={cfg.wandb.mode}: expected one of {', '.join(WANDB_MODES)}")
    if cfg.logger == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            'logger=wandb: the wandb package is not installed; pip install "mpt[wandb]", or another logger'
        )
    if (
        cfg.logger == "tensorboard" and importlib.util.find_spec("tensorboard") is None
    ):  # torch's SummaryWriter needs it
        raise ConfigError(
            "logger=tensorboard: the tensorboard package is not installed; pip install tensorboard, or set logger=none"
        )
    if (cfg.schedule.steps is None) == (cfg.schedule.epochs is None):
        raise ConfigError(
            "schedule: set exactly one of schedule.steps and schedule.epochs "
            f"(got steps={cfg.schedule.steps}, epochs={cfg.schedule.epochs})"
        )
    validate_schedule_shape(cfg.schedule)
    validate_update_extras(cfg)
    if cfg.optim.implementation not in OPTIM_IMPLEMENTATIONS:
        raise ConfigError(
            f"optim.implementation={cfg.optim.implementation}: expected one of {', '.join(OPTIM_IMPLEMENTATIONS)}"
        )
    if cfg.optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.optim.name}: expected one of {', '.join(OPTIMIZERS)}")

    if cfg.experiment is not None:
        validate_experiment(cfg)

    if cfg.stats.every < 1:
        raise ConfigError(f"stats.every={cfg.stats.every}: must be a positive number of steps")
    if not 0 < cfg.stats.keep <= 1:
        raise ConfigError(f"stats.keep={cfg.stats.keep}: must be a share in (0, 1]")


def validate_experiment(cfg: DictConfig) -> None:
    """A preset's declaration: a margin that can decide, and comparisons that name real settings."""
    e = cfg.experiment
    if not (e.margin >= 0 and math.isfinite(e.margin)):
        raise ConfigError(f"experiment.margin={e.margin}: must be a finite number >= 0")
    if e.seeds is not None:
        seeds = list(e.seeds)
        if len(seeds) < 2 or len(set(seeds)) != len(seeds) or min(seeds) < 0:
            raise ConfigError(
                f"experiment.seeds={seeds}: must be two or more distinct seeds >= 0 (an interval needs two pairs)"
            )
        if cfg.seed not in seeds:
            raise ConfigError(
                f"seed={cfg.seed} is not among experiment.seeds={seeds}, "
                "the pairs planned before the runs: run one of them"
            )
    for i, c in enumerate(e.comparisons):
        if not c.against:
            raise ConfigError(
                f"experiment.comparisons[{i}].against is empty: "
                "name the settings that make the baseline, e.g. {precision: fp32}"
            )
        for side in ("cell", "against"):
            for key in c[side]:
                if key not in GROUPS and OmegaConf.select(cfg, key, default=MISSING_KEY) is MISSING_KEY:
                    raise ConfigError(
                        f"experiment.comparisons[{i}].{side}: {key} is neither a config group "
                        f"({', '.join(GROUPS)}) nor a setting"
                    )


MISSING_KEY = object()


def static_scale_value(cfg: DictConfig) -> float:
    return float(cfg.scale.value if cfg.scale.value is not None else cfg.model.static_scale)


def as_plain(cfg: Any) -> Any:
    """The resolved config as plain Python (enums as their names), for records."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
