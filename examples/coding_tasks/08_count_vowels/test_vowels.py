from vowels import count_vowels


def test_count_vowels():
    assert count_vowels("Agentx IS fun") == 4
