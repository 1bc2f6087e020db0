"""When the cluster manager predicts a pool's scale-up, so that its model is read into the page cache first."""
from meshserve.cluster.dram_preload import TREND_WINDOW_S, DramPreloader


def test_a_rising_load_predicts_a_scale_up_of_a_pool_that_can_grow():
    preloader = DramPreloader()
    assert not preloader.predicts_scale_up("main/colocated", 0.0, load=4, target=1, held=0, most=2)  # one sample
    assert preloader.predicts_scale_up("main/colocated", 1.0, load=6, target=1, held=0, most=2)
    assert not preloader.predicts_scale_up("main/colocated", 2.0, load=3, target=1, held=0, most=2)  # fell
    # at its max a pool cannot grow, however its load rises
    assert not DramPreloader().predicts_scale_up("p", 0.0, load=1, target=2, held=0, most=2)


def test_the_trend_forgets_what_is_older_than_its_window():
    preloader = DramPreloader()
    preloader.predicts_scale_up("p", 0.0, load=9, target=1, held=0, most=4)
    assert not preloader.predicts_scale_up("p", 1.0, load=5, target=1, held=0, most=4)
    # the peak at 0 s left the window: 5 -> 6 is a rise
    assert preloader.predicts_scale_up("p", TREND_WINDOW_S + 0.5, load=6, target=1, held=0, most=4)


def test_a_pool_at_zero_or_with_held_jobs_is_predicted_to_scale_up():
    assert DramPreloader().predicts_scale_up("p", 0.0, load=0, target=0, held=0, most=2)
    assert DramPreloader().predicts_scale_up("p", 0.0, load=0, target=1, held=3, most=2)
    assert not DramPreloader().predicts_scale_up("p", 0.0, load=0, target=1, held=0, most=2)
