from calc import subtract


def test_subtract():
    assert subtract(10, 4) == 6
