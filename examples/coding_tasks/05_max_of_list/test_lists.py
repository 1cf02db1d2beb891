from lists import largest


def test_largest():
    assert largest([3, 1, 2]) == 3
    assert largest([1, 2, 9]) == 9
