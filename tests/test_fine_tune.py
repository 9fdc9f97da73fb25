"""`lit_memory.fine_tune`: a fit reads its data once, in the data module it trains with, and writes what the labels
show into the settings and into that module, as a module built from the final settings would hold them."""

from __future__ import annotations

from conftest import write_csv

from lit_memory.cli import resolve
from lit_memory.data import TextClassificationData

TINY_BERT = ('--model.config_overrides={"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
             '"intermediate_size": 128}')


def test_a_fit_reads_its_data_once_into_the_module_it_trains_with(tmp_path, monkeypatch):
    path = write_csv(tmp_path / "small.csv", [{"text": f"row {i} {'good' if i % 2 else 'bad'}", "label": i % 2}
                                              for i in range(600)])
    reads = []
    read = TextClassificationData._read
    monkeypatch.setattr(TextClassificationData, "_read", lambda self: reads.append(self) or read(self))
    cli = resolve(["fit", "--recipe", "4gb", f"--data.source={path}", "--model.pretrained=false", TINY_BERT,
                   f"--trainer.default_root_dir={tmp_path / 'run'}"])
    with cli.scope():
        cli.build(trainer=False)
        cli.datamodule.prepare_data()  # what Lightning calls first in the fit: the rows already read
    assert reads == [cli.datamodule]  # one read, by the module the run trains with
    settings, module = cli.settings, cli.datamodule
    assert (settings.model.num_labels, settings.model.problem_type) == (2, "single_label_classification")
    assert settings.trainer.max_epochs == 20 and module.epochs_raised_from == 1  # 15 steps an epoch: 300 in 20
    fresh = TextClassificationData(**settings.data.as_dict())  # as the settings now say: the same hyper-parameters
    assert {k: module.hparams[k] for k in fresh.hparams} == dict(fresh.hparams)
    assert module.kind_set is cli.model.kind  # the kind the labels showed, one object from the data to the model
