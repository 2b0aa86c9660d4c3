"""The words of a question and of an entry: what `rgt explain` indexes and compares.

The text is lowercased and cut into words; a few multi-word phrases become one term first
("out of memory" -> oom, "learning rate" -> lr, "df -i" -> inode), words in SYNONYMS become their
group's term (hung, stuck, frozen -> hang; card -> gpu), filler words are dropped, and a light
stemmer strips common endings (crashes, crashed, crashing -> crash). A run of Chinese characters
gives the English terms of the ZH_WORDS it holds and the character pairs of the rest. Queries and
entries go through the same `tokenize`, so a term means the same on both sides.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Dict, List, Tuple

STOPWORDS = frozenset("""
a about after again all also am an and any are as at be because been before being but by can could
did do does doing done each even ever for from had has have having he her here him his how i if in
into is it its just like me more most my no nor not now of on once only or other our out over own
same she should so some such than that the their them then there these they this those through to
too under until up very was we were what when where which while who why will with would you your
yet still got get gets getting keep keeps kept seems seem think really just thing things using use
used one way every whole instead ok okay anymore simply go goes going went says say said
""".split())

# Multi-word phrases first (on lowercased text with punctuation turned into spaces), in this order:
# (pattern, term, anchor). A pattern runs only on text that holds its anchor (any text for ""), so
# a question compiles only the few patterns it can match.
PHRASES: Tuple[Tuple[str, str, str], ...] = (
    (r"\b(?:(?:ran|run|runs|running) )?out of (?:gpu |cuda |video |host |system |cpu )?memory\b", "oom",
     "out of"),
    (r"\bnot a number\b", "nan", "not a number"),
    (r"\bnon finite\b", "nan", "non finite"),
    (r"\bno space left(?: on device)?\b", "disk full", "no space left"),
    (r"\b(?:(?:ran|run|runs|running) )?out of (?:disk space|disk|space|storage)\b", "disk full",
     "out of"),
    (r"\bdf i\b", "inode", "df i"),
    (r"\b(?:gpu|cuda|video|device) memory\b", "vram", " memory"),
    (r"\b(?:host|system|cpu|main) memory\b", "ram", " memory"),
    (r"\blearning rate\b", "lr", "learning rate"),
    (r"\bwarm up\b", "warmup", "warm up"),
    (r"\bhalf precision\b", "fp16", "half precision"),
    (r"\bmixed precision\b", "amp", "mixed precision"),
    (r"\bgrad(?:ient)? scaler\b", "scaler", " scaler"),
    (r"\bloss scal(?:e|es|ing|er)\b", "scaler", "loss scal"),
    (r"\ball (?:reduce|gather)\b", "allreduce", "all "),
    (r"\bdata ?load(?:er|ers|ing)\b", "dataloader", "load"),
    (r"\binput pipeline\b", "dataloader", "input pipeline"),
    (r"\bnum workers\b", "numworkers", "num workers"),
    (r"\bweights (?:and|&) biases\b", "wandb", "biases"),
    (r"\bstart(?:s|ed|ing)? (?:over|from scratch)\b", "restart", "start"),
    (r"\b\d{2,3} ?(?:c|deg|degc)\b", "hot", ""),
    (r"\bshot up\b", "spike", "shot up"),
    (r"\bblew up\b", "spike", "blew up"),
    (r"\btime[sd]? out\b", "timeout", " out"),
    (r"\bfall(?:en|s)? off(?: the)? bus\b", "offbus", "bus"),
    (r"\bstack ?trace\b", "traceback", "trace"),
)

# word -> the term of its group (the group's first word). Applied before stemming.
_GROUPS: Tuple[Tuple[str, ...], ...] = (
    ("nan", "nans", "nonfinite"),
    ("inf", "infinity", "infinite", "infs"),
    ("oom", "oomed", "oomkilled"),
    ("hang", "hung", "hangs", "hanging", "stuck", "freeze", "freezes", "froze", "frozen", "freezing",
     "stall", "stalled", "stalls", "stalling", "deadlock", "deadlocked", "deadlocks"),
    ("crash", "crashed", "crashes", "crashing", "died", "dies", "die", "dying", "dead"),
    ("kill", "killed", "kills", "sigkill"),
    ("gpu", "gpus", "card", "cards"),
    ("util", "utilization", "utilisation", "utilized", "usage", "busy"),
    ("slow", "slower", "slowly", "sluggish", "slowdown", "crawl", "crawling"),
    ("restart", "restarted", "restarts", "restarting", "relaunch", "relaunched", "relaunching", "rerun",
     "reran", "again"),
    ("resume", "resumed", "resumes", "resuming"),
    ("checkpoint", "checkpoints", "ckpt", "ckpts", "snapshot", "snapshots"),
    ("step", "steps", "iteration", "iterations", "iter", "iters"),
    ("zero", "0", "zeros", "zeroes"),
    ("disk", "disks", "storage", "filesystem", "drive", "partition"),
    ("full", "filled", "fills", "fill"),
    ("inode", "inodes"),
    ("hot", "temperature", "temp", "heat", "overheating", "overheat", "overheated", "thermal",
     "degrees", "celsius"),
    ("throttle", "throttled", "throttling", "throttles"),
    ("log", "logs", "stdout"),
    ("wandb", "mlflow", "tensorboard", "comet", "tracker", "trackers"),
    ("ssh", "sshd", "connection", "disconnect", "disconnected", "disconnects"),
    ("preempt", "preempted", "preemption", "preemptible", "spot", "interruptible", "interrupted",
     "interruption", "reclaimed", "reclaim", "evicted", "eviction"),
    ("reboot", "rebooted", "rebooting", "reboots"),
    ("allreduce", "collective", "collectives", "barrier", "broadcast", "allgather"),
    ("dataloader", "loader", "loaders", "dataloaders"),
    ("eval", "evaluation", "evaluate", "evaluating", "validation", "validate", "validating", "val"),
    ("metric", "metrics", "accuracy", "acc", "map", "miou", "f1", "bleu", "auc"),
    ("spike", "spiked", "spikes", "jump", "jumped", "jumps", "surge", "surged"),
    ("fp16", "float16", "half", "f16"),
    ("bf16", "bfloat16", "bfloat"),
    ("fp32", "float32"),
    ("amp", "autocast"),
    ("scaler", "gradscaler", "scalers"),
    ("vanish", "vanished", "vanishes", "disappeared", "disappear", "disappears", "gone"),
    ("buffer", "buffered", "buffering", "unbuffered", "flush", "flushed", "flushing"),
    ("corrupt", "corrupted", "corruption", "truncated", "broken", "damaged", "garbled"),
    ("thread", "threads", "omp", "openmp", "mkl"),
    ("xid", "xids", "nvrm"),
    ("rank", "ranks"),
    ("bill", "billing", "billed", "bills", "pay", "paying", "paid", "charge", "charged", "charges",
     "charging", "meter", "metered", "cost", "costs", "invoice"),
)
SYNONYMS: Dict[str, str] = {w: g[0] for g in _GROUPS for w in g if " " not in w}

# Chinese words -> the English words they mean, matched longest first inside a run of Chinese
# characters; what no word covers is indexed as overlapping character pairs (bigrams), so Chinese
# symptoms match Chinese questions too. The English side then goes through SYNONYMS and the stemmer.
ZH_WORDS: Dict[str, str] = {
    "爆显存": "oom", "显存溢出": "oom", "显存不足": "oom", "显存不够": "oom", "内存溢出": "oom",
    "显存": "vram", "内存": "ram", "显卡": "gpu", "掉卡": "offbus", "降频": "throttle", "温度": "temperature",
    "卡住": "hang", "卡死": "hang", "卡着": "hang", "不动": "hang", "假死": "hang", "死锁": "hang",
    "挂起": "hang", "崩溃": "crash", "挂了": "crash", "报错": "error", "错误": "error",
    "关机": "shutdown", "开机": "start", "释放": "release", "销毁": "destroy", "删除": "delete",
    "删掉": "delete", "计费": "billing", "扣费": "billing", "收费": "billing", "费用": "cost",
    "欠费": "negative balance", "余额": "balance", "实例": "instance", "容器": "container",
    "数据盘": "data disk", "系统盘": "system disk", "硬盘": "disk", "磁盘": "disk", "网盘": "netdisk",
    "空间不足": "disk full", "满了": "full", "文件存储": "storage", "存储": "storage",
    "断点续训": "resume", "续训": "resume", "恢复训练": "resume", "从头开始": "restart",
    "重新开始": "restart", "重启": "restart", "检查点": "checkpoint", "权重": "weights",
    "保存": "save", "加载": "load", "丢失": "lost", "丢了": "lost",
    "梯度": "gradient", "爆炸": "explode", "损失": "loss", "学习率": "lr", "批大小": "batch",
    "半精度": "fp16", "混合精度": "amp", "精度": "precision", "收敛": "converge", "不收敛": "not converge",
    "过拟合": "overfit", "验证集": "validation", "测试集": "test", "训练集": "train", "数据集": "dataset",
    "数据加载": "dataloader", "数据增强": "augmentation", "增强": "augmentation", "利用率": "util",
    "随机种子": "seed", "种子": "seed", "可复现": "reproducible", "复现": "reproduce",
    "不确定": "nondeterministic",
    "评估": "eval", "指标": "metric", "准确率": "accuracy", "噪声": "noise", "显著": "significant",
    "方差": "variance", "多卡": "multi gpu", "单卡": "single gpu", "分布式": "distributed",
    "镜像": "mirror", "代理": "proxy", "下载": "download", "学术加速": "accelerator proxy",
    "很慢": "slow", "变慢": "slow", "太慢": "slow", "慢": "slow", "断开": "disconnect", "断线": "disconnect",
    "掉线": "disconnect", "连不上": "connection fail", "连接": "connection", "超时": "timeout",
    "进程": "process", "杀掉": "kill", "被杀": "killed", "日志": "log", "输出": "output",
    "抢占": "preempt", "竞价": "spot", "中断": "interrupted", "无卡模式": "cpu mode", "训练": "train",
}
# Characters of grammar, not meaning: a bigram holding one is not indexed.
_ZH_FILLER = frozenset("的了是我你他她它在吗呢吧啊就都也和有这那个么怎什为会要把被还又很到说着过给让用对从"
                       "而与及或但如果该请")
_ZH_LONGEST = max(map(len, ZH_WORDS))

_NOT_WORD = re.compile(r"[^a-z0-9]+")


def stem(word: str) -> str:
    """A light suffix stripper (plural, -ed, -ing, -ly, final e); the same for queries and entries."""
    if len(word) <= 3 or word.isdigit():
        return word
    for suffix, repl in (("sses", "ss"), ("ies", "y"), ("xes", "x"), ("ches", "ch"), ("shes", "sh"),
                         ("zes", "z")):
        if word.endswith(suffix):
            return word[: -len(suffix)] + repl
    if word.endswith("ing") and len(word) > 5:
        word = _undouble(word[:-3])
    elif word.endswith("ed") and len(word) >= 4:
        word = _undouble(word[:-2])
    elif word.endswith("ly") and len(word) > 5:
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    return word


def _undouble(word: str) -> str:
    if len(word) > 2 and word[-1] == word[-2] and word[-1] not in "aeioulsz":
        return word[:-1]
    return word


@dataclasses.dataclass(frozen=True)
class Token:
    term: str   # what is indexed and compared
    word: str   # what the person wrote (for the "matched" list)


def is_cjk(ch: str) -> bool:
    """A CJK ideograph (the unified block, extension A, the compatibility block). A function, not a
    regex class: compiling a class this wide costs ~2 ms at every start of `rgt`."""
    return "\u3400" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff"


def cjk_runs(text: str) -> List[Tuple[int, int]]:
    """(start, end) of each run of CJK characters in `text`."""
    if text.isascii():
        return []
    runs: List[Tuple[int, int]] = []
    start = -1
    for i, ch in enumerate(text):
        if is_cjk(ch):
            if start < 0:
                start = i
        elif start >= 0:
            runs.append((start, i))
            start = -1
    if start >= 0:
        runs.append((start, len(text)))
    return runs


def tokenize(text: str) -> List[Token]:
    """Terms of `text` in order: phrases joined, synonyms merged, stopwords dropped, stemmed; a run of
    Chinese characters gives its ZH_WORDS and the bigrams of what is left."""
    out: List[Token] = []
    low, start = text.lower(), 0
    for begin, end in cjk_runs(low):
        out += _latin_tokens(low[start:begin])
        out += _zh_tokens(low[begin:end])
        start = end
    out += _latin_tokens(low[start:])
    return out


@functools.lru_cache(maxsize=8192)
def _term(word: str) -> str:
    return stem(SYNONYMS.get(word, word))


def _latin_tokens(text: str) -> List[Token]:
    flat = _NOT_WORD.sub(" ", text)
    for pattern, term, anchor in PHRASES:
        if anchor in flat:
            flat = re.sub(pattern, f" {term.replace(' ', '_')} ", flat)
    out: List[Token] = []
    for raw in flat.split():
        for piece in raw.split("_") if "_" in raw else (raw,):
            word = piece
            if word in STOPWORDS or (len(word) == 1 and not word.isdigit()):
                continue
            out.append(Token(_term(word), word))
    return out


def _zh_tokens(run: str) -> List[Token]:
    """ZH_WORDS found longest first, left to right; bigrams of the stretches between them."""
    out: List[Token] = []
    start = at = 0
    while at < len(run):
        word = next((run[at:at + n] for n in range(min(_ZH_LONGEST, len(run) - at), 0, -1)
                     if run[at:at + n] in ZH_WORDS), None)
        if word is None:
            at += 1
            continue
        out += _bigrams(run[start:at])
        out += [Token(t.term, word) for t in _latin_tokens(ZH_WORDS[word])]
        at = start = at + len(word)
    return out + _bigrams(run[start:])


def _bigrams(run: str) -> List[Token]:
    pairs = [run[i:i + 2] for i in range(len(run) - 1)] if len(run) > 1 else [run] if run else []
    return [Token(p, p) for p in pairs if not any(c in _ZH_FILLER for c in p)]


def terms(text: str) -> List[str]:
    return [t.term for t in tokenize(text)]


__all__ = ["PHRASES", "STOPWORDS", "SYNONYMS", "Token", "ZH_WORDS", "stem", "terms", "tokenize"]
