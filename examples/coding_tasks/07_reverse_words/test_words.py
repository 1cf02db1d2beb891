from words import reverse_words


def test_reverse_words():
    assert reverse_words("one two three") == "three two one"
