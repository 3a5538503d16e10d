"""The position-aligned synthetic tasks of fpscale.data.synthetic: group word problems (checked
against permutation matrices, an independent composition), copy_sep and induction."""
import itertools

import numpy as np
import pytest

from fpscale.data.synthetic import SyntheticTask, cayley_table, group_elements, group_products


def perm_matrix(p):
    """P[p[i], i] = 1, so P(p) e_i = e_{p(i)} and P(p o g) = P(p) P(g)."""
    n = len(p)
    m = np.zeros((n, n), dtype=int)
    m[list(p), list(range(n))] = 1
    return m


@pytest.mark.parametrize("name,size,n", [("s3", 6, 3), ("a4", 12, 4), ("a5", 60, 5)])
def test_groups_have_the_right_elements(name, size, n):
    elems = group_elements(name)
    assert len(elems) == len(set(elems)) == size
    for e in elems:
        det = round(np.linalg.det(perm_matrix(e)))
        assert sorted(e) == list(range(n))
        assert name == "s3" or det == 1          # alternating groups: even permutations only
    table = cayley_table(name)
    assert all(sorted(row) == list(range(size)) for row in table)       # a Latin square: closed, invertible


@pytest.mark.parametrize("name", ["s3", "a4", "a5"])
def test_prefix_products_match_permutation_matrices(name):
    elems = group_elements(name)
    task = SyntheticTask(name, len(elems), 24, seed=3)
    for i in range(20):
        word, target = task.example(i)
        acc = np.eye(len(elems[0]), dtype=int)
        for t, g in enumerate(word):
            acc = acc @ perm_matrix(elems[g])
            assert (perm_matrix(elems[target[t]]) == acc).all()


def test_products_are_non_commutative_and_depend_on_order():
    word = np.array([1, 2, 3])
    assert group_products("s3", word)[-1] != group_products("s3", word[::-1])[-1]


def test_examples_are_a_pure_function_of_seed_and_index():
    for name, kw in [("a5", {}), ("copy_sep", {"min_len": 3, "max_len": 8}), ("induction", {"distractors": 5})]:
        a = SyntheticTask(name, 60, 32, seed=5, **kw)
        b = SyntheticTask(name, 60, 32, seed=5, **kw)
        xa, ya = a.examples([0, 7, 11])
        xb, yb = b.examples([11, 0, 7])
        assert (xa[0] == xb[1]).all() and (ya[2] == yb[0]).all()
        assert not (a.examples([1])[0] == SyntheticTask(name, 60, 32, seed=6, **kw).examples([1])[0]).all()


def test_copy_sep_layout():
    task = SyntheticTask("copy_sep", 10, 20, seed=0, min_len=2, max_len=10)
    sep, pad = 8, 9
    lengths = set()
    for i in range(50):
        x, y = task.example(i)
        n = int(np.where(x == sep)[0][0])
        lengths.add(n)
        assert (x[:n] < 8).all() and (x[n + 1:2 * n] == x[:n - 1]).all() and (x[2 * n:] == pad).all()
        assert (y[n:2 * n] == x[:n]).all() and (y[:n] == -100).all() and (y[2 * n:] == -100).all()
    assert min(lengths) >= 2 and max(lengths) <= 10 and len(lengths) > 3


@pytest.mark.parametrize("k", [0, 1, 8, 25])
def test_induction_layout(k):
    task = SyntheticTask("induction", 32, 64, seed=1, distractors=k)
    mask = 31
    for i in range(30):
        x, y = task.example(i)
        a, b = x[-2], y[-1]
        assert x[-1] == mask and (y[:-1] == -100).all() and b != a and b < mask
        where = [t for t in range(len(x) - 2) if x[t] == a]
        assert len(where) == k + 1                      # the true pair and k distractor pairs
        assert x[where[0] + 1] == b and where[0] < len(x) // 2
        assert all(x[t + 1] != b for t in where[1:])     # distractors: D != B
        assert (x[:-1] < mask).all()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticTask("a5", 30, 16, 0)
    with pytest.raises(ValueError, match="copy_sep"):
        SyntheticTask("copy_sep", 10, 10, 0, min_len=2, max_len=8)
    with pytest.raises(ValueError, match="induction"):
        SyntheticTask("induction", 32, 20, 0, distractors=12)
    with pytest.raises(ValueError, match="unknown"):
        SyntheticTask("s4", 32, 20, 0)
    with pytest.raises(ValueError, match="aligned"):
        SyntheticTask("a5", 60, 16, 0).sample(0)


def test_next_token_tasks_unchanged():
    task = SyntheticTask("periodic", 16, 12, seed=0, period=3)
    s = task.sample(4)
    assert len(s) == 13 and (s[3:] == s[:-3]).all()
    x, y = task.example(4)
    assert (x == s[:-1]).all() and (y == s[1:]).all()
    assert len(list(itertools.islice(iter(task.batch([0, 1])), 2))) == 2
    assert task.fingerprint() == "synthetic:periodic:v16:p3"      # checkpoints of earlier runs still resume


def test_the_authors_conventions_start_token_short_words_and_scored_specials():
    """start_token puts BOS = |G| in front (target BOS when score_specials, else -100);
    short_fraction makes that share of words length 2, padded with PAD = |G| + 1; the word itself
    (its first 2 elements for a short one) and its prefix products are those of the plain task."""
    from fpscale.data.synthetic import IGNORE, authors_short_fraction
    plain = SyntheticTask("s3", 6, 8, seed=4)
    task = SyntheticTask("s3", 8, 8, seed=4, start_token=True, short_fraction=0.3, score_specials=True)
    quiet = SyntheticTask("s3", 8, 8, seed=4, start_token=True, short_fraction=0.3)
    short = 0
    for i in range(200):
        word, target = plain.example(i)
        x, y = task.example(i)
        xq, yq = quiet.example(i)
        assert len(x) == len(y) == 9 and x[0] == 6 and y[0] == 6 and yq[0] == IGNORE
        assert (x == xq).all() and (y[1:3] == yq[1:3]).all()
        assert (x[1:3] == word[:2]).all() and (y[1:3] == target[:2]).all()
        if x[3] == 7:                    # a short word: PAD from position 2 of the word on
            short += 1
            assert (x[3:] == 7).all() and (y[3:] == 7).all() and (yq[3:] == IGNORE).all()
        else:
            assert (x[1:] == word).all() and (y[1:] == target).all() and (yq[1:] == target).all()
    assert 40 <= short <= 80             # 0.3 of 200 (binomial sd 6.5)
    assert task.fingerprint() != quiet.fingerprint() != plain.fingerprint()
    assert authors_short_fraction("s3") == pytest.approx(36 / (36 + 12.8e6))
    with pytest.raises(Exception, match="vocab_size 7 is too small"):
        SyntheticTask("s3", 7, 8, seed=0, start_token=True, short_fraction=0.1)
    with pytest.raises(Exception, match="options of the group tasks"):
        SyntheticTask("copy_sep", 8, 8, seed=0, start_token=True)
