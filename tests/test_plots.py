from llm_from_scratch.plots import line_plot, loss_plot, merges_plot


def test_loss_plot_draws_train_val_and_floor(tmp_path):
    records = [{"tokens": 100, "loss/train": 3.0}, {"tokens": 200, "loss/train": 2.0, },
               {"tokens": 200, "loss/val": 2.1}]
    fig = loss_plot(records, tmp_path / "loss.png", floor=0.5)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["train"].get_ydata()) == [3.0, 2.0] and list(lines["validation"].get_ydata()) == [2.1]
    assert list(lines["entropy floor 0.500"].get_ydata()) == [0.5, 0.5]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_line_and_merges_plots(tmp_path):
    fig = line_plot([1, 2], {"a": [3, 4]}, "x", "y", "t", tmp_path / "l.png", logx=True, hlines={"floor": 1.0})
    assert [t.get_text() for t in fig.axes[0].texts] == ["floor"] and fig.axes[0].texts[0].xy == (0.01, 1.0)
    assert [list(line.get_ydata()) for line in fig.axes[0].get_lines()][0] == [3, 4]
    fig = merges_plot(["·t", "he"], [10, 7], tmp_path / "m.png")
    assert [p.get_width() for p in fig.axes[0].patches] == [10, 7]
    assert (tmp_path / "m.png").exists()
