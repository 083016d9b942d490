from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402

from muse.plot_png import PALETTE_COLOURS, save_figure  # noqa: E402


def test_figures_are_saved_as_small_palette_pngs(tmp_path: Path) -> None:
    figure, axis = plt.subplots(figsize=(4, 3))
    for slope in range(8):
        axis.plot(range(50), [slope * x for x in range(50)], label=str(slope))
    axis.legend()
    save_figure(figure, tmp_path / "small.png", dpi=100)
    figure.savefig(tmp_path / "full.png", dpi=100)
    plt.close(figure)
    with Image.open(tmp_path / "small.png") as image:
        assert image.format == "PNG" and image.mode == "P"
        assert image.size == (400, 300)
        assert len(image.getcolors(256)) <= PALETTE_COLOURS
    assert (tmp_path / "small.png").stat().st_size < (tmp_path / "full.png").stat().st_size
