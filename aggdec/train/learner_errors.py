"""Synthetic learner errors: noisy -> clean training pairs for grammatical error correction.

`corrupt(sentence, rng)` returns a learner-like version of a clean English sentence and the error
types it applied. The error model imitates what English learners get wrong, drawn per sentence:

* number of errors: 0 with probability `LearnerErrors.p_clean` (default 0.25: the sentence is kept
  unchanged, so the model learns to leave good text alone), otherwise 1, 2, 3 or 4 with
  probabilities 0.45 / 0.30 / 0.15 / 0.10, at most one per four words (at least one);
* error types, drawn by weight among those that apply to the sentence (`ERROR_WEIGHTS`):

  ============== ====== ===================================================================
  type           weight what it does (clean -> noisy)
  ============== ====== ===================================================================
  spelling       0.19   a common learner misspelling ("because" -> "becouse"), else a
                        character slip: dropped, doubled, swapped or vowel-substituted letter
  agreement      0.12   subject-verb agreement: "she goes" -> "she go", "they are" -> "they
                        is", "has" <-> "have", "was" <-> "were", "does" <-> "do"
  verb_form      0.12   tense and form: past -> present ("went" -> "go", "yesterday she
                        go"), participle -> past ("have gone" -> "have went"), over-
                        regularised past ("bought" -> "buyed"), "-ing"/infinitive mix-ups
  article        0.12   article/determiner dropped, inserted or swapped (a/an/the,
                        this/these, much/many)
  preposition    0.10   preposition substituted (in/on/at/to/for/of/with/from/about/by),
                        dropped or inserted
  noun_number    0.08   plural -> singular or singular -> plural, irregular plurals
                        regularised ("children" -> "childs")
  word_form      0.06   adverb -> adjective ("quickly" -> "quick"), derivational
                        confusions ("happiness" -> "happy", "difficult" -> "difficulty")
  confusable     0.05   their/there, your/you're, its/it's, then/than, to/too, lose/loose
  missing_word   0.05   a function word dropped (is, are, to, it, be, will, that, ...)
  extra_word     0.04   a word repeated, or "the"/"to"/"of"/"very" inserted
  capitalization 0.04   sentence start or "I" lower-cased, a name lower-cased, a common word
                        capitalised
  punctuation    0.03   final punctuation or a comma dropped, a comma inserted
  ============== ====== ===================================================================

* orthography: with probability `LearnerErrors.p_tokenized` (default 0.5) both sides are written
  tokenised (Penn-Treebank style, as in learner corpora and the README's examples: "She went to
  school yesterday ." and "do n't"), else as the source text is written. Both sides of a pair
  always share the style, so the model learns to keep whichever it is given.

Everything is deterministic given the `random.Random` passed in (`generate` seeds one per
sentence from its index and a seed, so the output does not depend on batching or worker count).
The word lists are hand-written and small (common irregular verbs, learner misspellings,
derivational pairs); a sentence with no applicable site for a drawn type gets another type.

    python -m aggdec.train.learner_errors --input clean.txt --out pairs.tsv --copies 2 --seed 1
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ERROR_WEIGHTS: dict[str, float] = {
    "spelling": 0.19, "agreement": 0.12, "verb_form": 0.12, "article": 0.12, "preposition": 0.10,
    "noun_number": 0.08, "word_form": 0.06, "confusable": 0.05, "missing_word": 0.05, "extra_word": 0.04,
    "capitalization": 0.04, "punctuation": 0.03,
}
N_ERRORS = (1, 2, 3, 4)
N_ERRORS_P = (0.45, 0.30, 0.15, 0.10)

# -- lexicon --------------------------------------------------------------------------------------

# base, past, past participle (irregular verbs learners use most)
_IRREGULAR = """be was been|become became become|begin began begun|break broke broken|bring brought brought
build built built|buy bought bought|catch caught caught|choose chose chosen|come came come|cost cost cost
cut cut cut|do did done|draw drew drawn|drink drank drunk|drive drove driven|eat ate eaten|fall fell fallen
feel felt felt|fight fought fought|find found found|fly flew flown|forget forgot forgotten|get got got
give gave given|go went gone|grow grew grown|have had had|hear heard heard|hold held held|keep kept kept
know knew known|lead led led|leave left left|lend lent lent|let let let|lose lost lost|make made made
mean meant meant|meet met met|pay paid paid|put put put|read read read|ride rode ridden|ring rang rung
rise rose risen|run ran run|say said said|see saw seen|sell sold sold|send sent sent|set set set
shake shook shaken|shine shone shone|shoot shot shot|show showed shown|shut shut shut|sing sang sung
sit sat sat|sleep slept slept|speak spoke spoken|spend spent spent|stand stood stood|steal stole stolen
swim swam swum|take took taken|teach taught taught|tell told told|think thought thought|throw threw thrown
understand understood understood|wake woke woken|wear wore worn|win won won|write wrote written"""
IRREGULAR: dict[str, tuple[str, str]] = {}
for _entry in _IRREGULAR.replace("\n", "|").split("|"):
    _b, _p, _pp = _entry.split()
    IRREGULAR[_b] = (_p, _pp)

REGULAR_VERBS = set("""accept add agree allow answer appear arrive ask believe belong call change check clean close
collect compare complete consider contain continue cook create cry dance decide depend describe destroy develop
die discover discuss dress enjoy enter explain fail fill finish follow happen hate help hope improve include
increase invite join jump kill learn like listen live look love manage marry miss move need notice offer open
order own paint pass plan play point prefer prepare present prevent produce promise provide pull push reach
receive remember repeat reply report require return save seem share shout smile start stay stop study suggest
support talk thank touch travel try turn use visit wait walk want wash watch wish work worry""".split())

VOWELS = "aeiou"


def third_person(verb: str) -> str:
    """Present third-person singular of a base form ("go" -> "goes", "try" -> "tries")."""
    if verb == "be":
        return "is"
    if verb == "have":
        return "has"
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and len(verb) > 1 and verb[-2] not in VOWELS:
        return verb[:-1] + "ies"
    return verb + "s"


def regular_past(verb: str) -> str:
    """Regular past of a base form ("play" -> "played", "study" -> "studied", "stop" -> "stopped")."""
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and len(verb) > 1 and verb[-2] not in VOWELS:
        return verb[:-1] + "ied"
    if (len(verb) >= 3 and verb[-1] not in VOWELS + "wxy" and verb[-2] in VOWELS and verb[-3] not in VOWELS
            and verb in {"stop", "plan", "shop", "drop", "prefer", "travel", "admit", "beg", "rob", "hug"}):
        return verb + verb[-1] + "ed"
    return verb + "ed"


def ing_form(verb: str) -> str:
    if verb in {"be", "see", "agree"}:
        return verb + "ing"
    if verb.endswith("ie"):
        return verb[:-2] + "ying"
    if verb.endswith("e"):
        return verb[:-1] + "ing"
    if verb in {"stop", "plan", "shop", "drop", "run", "swim", "sit", "get", "put", "cut", "begin", "win"}:
        return verb + verb[-1] + "ing"
    return verb + "ing"


# surface form -> (base, kind) with kind in {"3sg", "past", "pp", "past_pp", "ing", "base"}
VERB_FORMS: dict[str, tuple[str, str]] = {}
for _b in sorted(set(IRREGULAR) | REGULAR_VERBS):
    if _b in IRREGULAR:
        _p, _pp = IRREGULAR[_b]
    else:
        _p = _pp = regular_past(_b)
    VERB_FORMS.setdefault(third_person(_b), (_b, "3sg"))
    VERB_FORMS.setdefault(ing_form(_b), (_b, "ing"))
    if _p == _pp:
        VERB_FORMS.setdefault(_p, (_b, "past_pp"))
    else:
        VERB_FORMS.setdefault(_p, (_b, "past"))
        VERB_FORMS.setdefault(_pp, (_b, "pp"))
    VERB_FORMS.setdefault(_b, (_b, "base"))
for _w in ("is", "are", "am", "was", "were", "been", "being", "has", "had", "does", "did"):
    VERB_FORMS.pop(_w, None)  # handled by AGREEMENT_SWAPS / auxiliaries

AGREEMENT_SWAPS = {"is": ("are",), "are": ("is",), "was": ("were",), "were": ("was",), "has": ("have",),
                   "have": ("has",), "does": ("do",), "do": ("does",), "doesn't": ("don't",), "don't": ("doesn't",),
                   "am": ("is", "are"), "isn't": ("aren't",), "aren't": ("isn't",), "wasn't": ("weren't",),
                   "weren't": ("wasn't",), "hasn't": ("haven't",), "haven't": ("hasn't",)}
SUBJECTS_3SG = {"he", "she", "it", "this", "that", "everyone", "everybody", "nobody", "someone", "somebody"}
SUBJECTS_PL = {"i", "you", "we", "they", "these", "those", "people"}

MISSPELLINGS = {
    "because": ["becouse", "beacause", "becuase"], "which": ["wich", "whitch"], "their": ["thier"],
    "believe": ["beleive", "belive"], "receive": ["recieve"], "different": ["diffrent", "differant"],
    "government": ["goverment"], "environment": ["enviroment"], "necessary": ["neccessary", "necesary"],
    "beautiful": ["beatiful", "beautifull"], "friend": ["freind", "frend"], "friends": ["freinds", "frends"],
    "really": ["realy"], "until": ["untill"], "tomorrow": ["tommorow", "tomorow"], "again": ["agian"],
    "definitely": ["definately"], "separate": ["seperate"], "occasion": ["ocassion"], "address": ["adress"],
    "advertisement": ["advertisment"], "knowledge": ["knowlege"], "important": ["importent", "importan"],
    "people": ["peole", "peaple", "poeple"], "interesting": ["intresting", "interesing"], "which's": ["wich's"],
    "success": ["sucess"], "successful": ["succesful", "successfull"], "opinion": ["oppinion", "opinon"],
    "probably": ["probaly", "propably"], "technology": ["tecnology", "technlogy"], "science": ["sience"],
    "young": ["yong"], "country": ["contry"], "countries": ["contries", "countrys"], "family": ["famly"],
    "usually": ["usualy"], "finally": ["finaly"], "especially": ["especialy"], "experience": ["experiance"],
    "future": ["futur"], "with": ["whit"], "what": ["wath"], "when": ["wen"], "where": ["were", "wher"],
    "think": ["thik"], "studying": ["studing"], "writing": ["writting"], "coming": ["comming"],
    "going": ["goin"], "although": ["altough", "allthough"], "through": ["throught", "trough"],
    "enough": ["enought", "enogh"], "problem": ["problam", "proble"], "problems": ["problemes"],
    "money": ["mony"], "always": ["allways", "alway"], "every": ["evry"], "everything": ["everithing"],
    "something": ["somthing"], "sometimes": ["somtimes"], "beginning": ["begining"], "writer": ["writter"],
    "opportunity": ["oportunity"], "responsibility": ["responsability"], "advantage": ["advantge"],
    "disadvantage": ["disadvantge"], "society": ["sociaty"], "business": ["buisness", "bussiness"],
    "restaurant": ["restaurent", "resturant"], "language": ["languge", "langage"], "English": ["Englsh"],
    "learn": ["lern"], "know": ["now"], "would": ["whould", "wuold"], "could": ["cuold"], "should": ["shuold"],
    "weather": ["wether"], "whether": ["wether"], "accommodation": ["accomodation"], "embarrass": ["embarass"],
    "surprise": ["suprise"], "foreign": ["foriegn"], "grammar": ["grammer"], "truly": ["truely"],
    "quite": ["quiet"], "lose": ["loose"], "choose": ["chose"], "student": ["studend"], "students": ["studens"],
    "teacher": ["techer"], "school": ["scool", "shool"], "children": ["childen", "chilren"],
    "believed": ["beleived"], "example": ["exemple", "exampel"], "decision": ["desicion"],
}

PREPOSITIONS = ["in", "on", "at", "to", "for", "of", "with", "from", "about", "by", "into"]
ARTICLES = {"a", "an", "the"}
DETERMINER_SWAPS = {"this": "these", "these": "this", "that": "those", "those": "that", "much": "many",
                    "many": "much", "few": "little", "little": "few", "less": "fewer", "fewer": "less",
                    "every": "all", "each": "every", "some": "any", "any": "some", "another": "other"}
MISSING_WORDS = {"is", "are", "am", "was", "were", "to", "it", "be", "will", "that", "there", "have", "has",
                 "do", "does", "can", "a", "an", "the", "of", "and"}
CONFUSABLES = [("their", "there"), ("there", "their"), ("they're", "their"), ("your", "you're"),
               ("you're", "your"), ("its", "it's"), ("it's", "its"), ("then", "than"), ("than", "then"),
               ("to", "too"), ("too", "to"), ("lose", "loose"), ("affect", "effect"), ("effect", "affect"),
               ("who's", "whose"), ("whose", "who's"), ("accept", "except"), ("advice", "advise"),
               ("make", "do"), ("do", "make"), ("say", "tell"), ("tell", "say"), ("borrow", "lend"),
               ("lend", "borrow"), ("learn", "teach"), ("teach", "learn"), ("see", "watch"),
               ("fun", "funny"), ("economic", "economical"), ("job", "work")]
WORD_FORMS = [("happiness", "happy"), ("success", "successful"), ("successful", "success"),
              ("difficult", "difficulty"), ("difficulty", "difficult"), ("important", "importance"),
              ("importance", "important"), ("beautiful", "beauty"), ("beauty", "beautiful"),
              ("different", "difference"), ("difference", "different"), ("healthy", "health"),
              ("health", "healthy"), ("interested", "interesting"), ("interesting", "interested"),
              ("bored", "boring"), ("boring", "bored"), ("excited", "exciting"), ("exciting", "excited"),
              ("tired", "tiring"), ("danger", "dangerous"), ("dangerous", "danger"), ("knowledge", "know"),
              ("decision", "decide"), ("decide", "decision"), ("life", "live"), ("live", "life"),
              ("advice", "advise"), ("choice", "choose"), ("choose", "choice"), ("economy", "economic"),
              ("economic", "economy"), ("free", "freedom"), ("freedom", "free"), ("good", "well"),
              ("well", "good"), ("easy", "easily"), ("easily", "easy"), ("hard", "hardly"),
              ("education", "educate"), ("educational", "education"), ("possible", "possibility"),
              ("able", "ability"), ("ability", "able"), ("safe", "safety"), ("safety", "safe"),
              ("comfortable", "comfort"), ("popular", "popularity"), ("responsible", "responsibility")]
IRREGULAR_PLURALS = {"children": "childs", "people": "peoples", "men": "mans", "women": "womans",
                     "feet": "foots", "teeth": "tooths", "mice": "mouses", "lives": "lifes", "knives": "knifes",
                     "wives": "wifes", "leaves": "leafs", "information": "informations", "advice": "advices",
                     "furniture": "furnitures", "equipment": "equipments", "homework": "homeworks",
                     "research": "researches", "news": "new", "luggage": "luggages", "knowledge": "knowledges"}
PLURAL_CUES = {"two", "three", "four", "five", "many", "several", "some", "these", "those", "few", "all", "both",
               "various", "other", "lots"}
NOT_NOUNS = set("is was has does this his its us yes thus plus less unless always perhaps news series species "
                "means ones whose across famous various previous serious obvious analysis basis".split())

PTB_CONTRACTIONS = re.compile(r"(?i)\b(\w+)(n't|'s|'re|'ve|'ll|'d|'m)\b")
TOKEN_RE = re.compile(r"\w+(?:[-']\w+)*|\S")


# -- tokens ---------------------------------------------------------------------------------------

@dataclass
class Tok:
    text: str
    space: bool  # whitespace before this token in the source's own orthography


def tokenize(sentence: str) -> list[Tok]:
    """Words (with inner hyphens/apostrophes) and single punctuation marks, with their spacing."""
    out = []
    for m in TOKEN_RE.finditer(sentence):
        out.append(Tok(m.group(), m.start() > 0 and sentence[m.start() - 1].isspace()))
    return out


def render(toks: list[Tok], tokenized: bool) -> str:
    """Text of `toks`: as spaced in the source, or Penn-Treebank-like (every token space-separated,
    contractions split: "don't" -> "do n't")."""
    if tokenized:
        return " ".join(PTB_CONTRACTIONS.sub(r"\1 \2", t.text) for t in toks)
    return "".join((" " if t.space and i else "") + t.text for i, t in enumerate(toks))


def _is_word(t: Tok) -> bool:
    return t.text[0].isalpha()


def _match_case(new: str, old: str) -> str:
    if old[:1].isupper() and new[:1].islower():
        return new[0].upper() + new[1:]
    return new


# -- error operations: each mutates `toks` in place and returns True when it applied ----------------

def _sites(toks: list[Tok], pred) -> list[int]:
    return [i for i, t in enumerate(toks) if pred(i, t)]


def _replace(toks: list[Tok], i: int, new: str) -> None:
    toks[i] = Tok(_match_case(new, toks[i].text), toks[i].space)


def _char_slip(word: str, rng: random.Random) -> str:
    if len(word) < 4:
        return word
    i = rng.randrange(1, len(word) - 1)
    op = rng.choice(("drop", "double", "swap", "vowel"))
    if op == "drop":
        return word[:i] + word[i + 1:]
    if op == "double":
        return word[:i] + word[i] + word[i:]
    if op == "swap":
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    vs = [j for j in range(1, len(word)) if word[j] in VOWELS]
    if not vs:
        return word
    j = rng.choice(vs)
    return word[:j] + rng.choice([v for v in VOWELS if v != word[j]]) + word[j + 1:]


def err_spelling(toks, rng) -> bool:
    known = _sites(toks, lambda i, t: t.text in MISSPELLINGS or t.text.lower() in MISSPELLINGS)
    if known and rng.random() < 0.6:
        i = rng.choice(known)
        _replace(toks, i, rng.choice(MISSPELLINGS.get(toks[i].text) or MISSPELLINGS[toks[i].text.lower()]))
        return True
    words = _sites(toks, lambda i, t: _is_word(t) and len(t.text) >= 4 and t.text.isalpha())
    if not words:
        return False
    i = rng.choice(words)
    new = _char_slip(toks[i].text, rng)
    if new == toks[i].text:
        return False
    toks[i] = Tok(new, toks[i].space)
    return True


def err_agreement(toks, rng) -> bool:
    sites = _sites(toks, lambda i, t: t.text.lower() in AGREEMENT_SWAPS)
    low = [t.text.lower() for t in toks]
    # "she goes" -> "she go"; "they go" -> "they goes" (a 3sg/base verb right after a pronoun subject)
    for i in range(1, len(toks)):
        form = VERB_FORMS.get(low[i])
        if form and ((form[1] == "3sg" and low[i - 1] in SUBJECTS_3SG)
                     or (form[1] == "base" and low[i - 1] in SUBJECTS_PL)):
            sites.append(i)
    if not sites:
        return False
    i = rng.choice(sites)
    w = low[i]
    if w in AGREEMENT_SWAPS:
        _replace(toks, i, rng.choice(AGREEMENT_SWAPS[w]))
    else:
        base, kind = VERB_FORMS[w]
        _replace(toks, i, base if kind == "3sg" else third_person(base))
    return True


def err_verb_form(toks, rng) -> bool:
    low = [t.text.lower() for t in toks]
    sites = [i for i, w in enumerate(low) if w in VERB_FORMS and VERB_FORMS[w][1] != "base"]
    sites += [i for i, w in enumerate(low) if w in ("was", "were", "had", "did")]
    if not sites:
        return False
    i = rng.choice(sites)
    w = low[i]
    if w in ("was", "were", "had", "did"):
        _replace(toks, i, {"was": "is", "were": "are", "had": "have", "did": "do"}[w])
        return True
    base, kind = VERB_FORMS[w]
    past, pp = IRREGULAR.get(base, (regular_past(base),) * 2)
    choices = {
        "past": [base, base, pp, regular_past(base) if base in IRREGULAR else base],
        "pp": [past, past, base, regular_past(base) if base in IRREGULAR else base],
        "past_pp": [base, base, regular_past(base) if base in IRREGULAR else third_person(base)],
        "3sg": [base, past],
        "ing": [base, base + "ing" if not ing_form(base).startswith(base) else base, past],
    }[kind]
    new = rng.choice(choices)
    if new == w:
        return False
    _replace(toks, i, new)
    return True


def err_article(toks, rng) -> bool:
    low = [t.text.lower() for t in toks]
    arts = [i for i, w in enumerate(low) if w in ARTICLES]
    dets = [i for i, w in enumerate(low) if w in DETERMINER_SWAPS]
    r = rng.random()
    if arts and r < 0.5:  # drop an article
        i = rng.choice(arts)
        if i == 0 and len(toks) > 1:
            toks[1] = Tok(_match_case(toks[1].text, toks[0].text), toks[0].space)
        del toks[i]
        return True
    if arts and r < 0.75:  # wrong article
        i = rng.choice(arts)
        _replace(toks, i, rng.choice(sorted(ARTICLES - {low[i]})))
        return True
    if dets and r < 0.85:
        i = rng.choice(dets)
        _replace(toks, i, DETERMINER_SWAPS[low[i]])
        return True
    # insert an article before a lower-case word that follows a preposition or verb-ish word
    sites = [i for i in range(1, len(toks)) if _is_word(toks[i]) and toks[i].text.islower()
             and low[i - 1] in set(PREPOSITIONS) | {"is", "was", "have", "has", "like", "play", "go"}
             and low[i] not in ARTICLES and low[i] not in DETERMINER_SWAPS]
    if not sites:
        return False
    i = rng.choice(sites)
    toks.insert(i, Tok(rng.choice(("the", "the", "a")), True))
    return True


def err_preposition(toks, rng) -> bool:
    low = [t.text.lower() for t in toks]
    sites = [i for i, w in enumerate(low) if w in PREPOSITIONS]
    r = rng.random()
    if sites and r < 0.7:
        i = rng.choice(sites)
        _replace(toks, i, rng.choice([p for p in PREPOSITIONS if p != low[i]]))
        return True
    if sites and r < 0.9:
        i = rng.choice(sites)
        if i == 0:
            return False
        del toks[i]
        return True
    verbs = [i for i in range(len(toks) - 1) if low[i] in VERB_FORMS and _is_word(toks[i + 1])]
    if not verbs:
        return False
    i = rng.choice(verbs)
    toks.insert(i + 1, Tok(rng.choice(("to", "to", "for", "about", "in", "at")), True))
    return True


def _pluralise(w: str) -> str:
    if w.endswith(("s", "sh", "ch", "x", "z")):
        return w + "es"
    if w.endswith("y") and len(w) > 1 and w[-2] not in VOWELS:
        return w[:-1] + "ies"
    return w + "s"


def err_noun_number(toks, rng) -> bool:
    low = [t.text.lower() for t in toks]
    irregular = [i for i, w in enumerate(low) if w in IRREGULAR_PLURALS]
    if irregular and rng.random() < 0.5:
        i = rng.choice(irregular)
        _replace(toks, i, IRREGULAR_PLURALS[low[i]])
        return True
    plurals = [i for i in range(len(toks)) if _is_word(toks[i]) and toks[i].text.islower() and len(low[i]) > 3
               and low[i].endswith("s") and not low[i].endswith(("ss", "us", "is")) and low[i] not in NOT_NOUNS
               and low[i] not in VERB_FORMS and (i == 0 or low[i - 1] not in SUBJECTS_3SG)]
    singulars = [i for i in range(1, len(toks)) if low[i - 1] in {"a", "an", "one", "each", "every", "this"}
                 and _is_word(toks[i]) and toks[i].text.islower() and not low[i].endswith("s") and len(low[i]) > 2]
    if not plurals and not singulars:
        return False
    if plurals and (not singulars or rng.random() < 0.6):
        i = rng.choice(plurals)
        w = low[i]
        new = w[:-3] + "y" if w.endswith("ies") else w[:-2] if w.endswith(("shes", "ches", "xes")) else w[:-1]
    else:
        i = rng.choice(singulars)
        new = _pluralise(low[i])
    _replace(toks, i, new)
    return True


def err_word_form(toks, rng) -> bool:
    low = [t.text.lower() for t in toks]
    table = dict(WORD_FORMS)
    sites = [i for i, w in enumerate(low) if w in table]
    adverbs = [i for i, w in enumerate(low) if w.endswith("ly") and len(w) > 5 and w not in {"only", "family", "early",
                                                                                             "daily", "reply", "apply",
                                                                                             "supply", "italy", "july"}]
    if not sites and not adverbs:
        return False
    if sites and (not adverbs or rng.random() < 0.6):
        i = rng.choice(sites)
        _replace(toks, i, table[low[i]])
    else:
        i = rng.choice(adverbs)
        w = low[i]
        _replace(toks, i, w[:-3] + "y" if w.endswith("ily") else w[:-2])
    return True


def err_confusable(toks, rng) -> bool:
    low = [t.text.lower() for t in toks]
    sites = [(i, b) for i, w in enumerate(low) for a, b in CONFUSABLES if w == a]
    if not sites:
        return False
    i, new = rng.choice(sites)
    _replace(toks, i, new)
    return True


def err_missing_word(toks, rng) -> bool:
    sites = [i for i, t in enumerate(toks) if t.text.lower() in MISSING_WORDS and i > 0]
    if not sites:
        return False
    del toks[rng.choice(sites)]
    return True


def err_extra_word(toks, rng) -> bool:
    words = [i for i, t in enumerate(toks) if _is_word(t)]
    if not words:
        return False
    i = rng.choice(words)
    if rng.random() < 0.4:
        toks.insert(i + 1, Tok(toks[i].text.lower(), True))
    else:
        toks.insert(i, Tok(rng.choice(("the", "to", "of", "very", "is", "a", "more")), i > 0))
        if i == 0:
            toks[0] = Tok(_match_case(toks[0].text, toks[1].text), False)
            toks[1] = Tok(toks[1].text[0].lower() + toks[1].text[1:] if toks[1].text != "I" else "I", True)
    return True


def err_capitalization(toks, rng) -> bool:
    sites = [i for i, t in enumerate(toks) if _is_word(t) and t.text[0].isupper()]
    r = rng.random()
    if sites and r < 0.8:
        i = rng.choice(sites)
        w = toks[i].text
        if w.isupper() and len(w) > 1:  # acronyms stay
            return False
        toks[i] = Tok(w[0].lower() + w[1:], toks[i].space)
        return True
    lower = [i for i, t in enumerate(toks) if _is_word(t) and t.text.islower() and i > 0]
    if not lower:
        return False
    i = rng.choice(lower)
    toks[i] = Tok(toks[i].text.capitalize(), toks[i].space)
    return True


def err_punctuation(toks, rng) -> bool:
    r = rng.random()
    if toks and toks[-1].text in ".!?" and len(toks) > 1 and r < 0.5:
        del toks[-1]
        return True
    commas = [i for i, t in enumerate(toks) if t.text == ","]
    if commas and r < 0.85:
        del toks[rng.choice(commas)]
        return True
    words = [i for i in range(1, len(toks) - 1) if _is_word(toks[i]) and toks[i].text.lower() in
             {"and", "but", "because", "that", "which", "so", "when", "if"}]
    if not words:
        return False
    toks.insert(rng.choice(words), Tok(",", False))
    return True


OPERATIONS = {
    "spelling": err_spelling, "agreement": err_agreement, "verb_form": err_verb_form, "article": err_article,
    "preposition": err_preposition, "noun_number": err_noun_number, "word_form": err_word_form,
    "confusable": err_confusable, "missing_word": err_missing_word, "extra_word": err_extra_word,
    "capitalization": err_capitalization, "punctuation": err_punctuation,
}
assert set(OPERATIONS) == set(ERROR_WEIGHTS)


# -- the generator --------------------------------------------------------------------------------

@dataclass(frozen=True)
class LearnerErrors:
    """The error model's knobs: share of sentences kept clean and share written tokenised."""

    p_clean: float = 0.25
    p_tokenized: float = 0.5

    def corrupt(self, sentence: str, rng: random.Random) -> tuple[str, str, list[str]]:
        """-> (noisy, clean, applied error types) for one clean sentence.

        `clean` is `sentence` in the drawn orthography (as written, or tokenised); `noisy` equals
        `clean` when no error was drawn or none applied. Uses only `rng` for randomness.
        """
        toks = tokenize(sentence)
        tokenized = rng.random() < self.p_tokenized
        clean = render(toks, tokenized) if tokenized else sentence
        if not toks or rng.random() < self.p_clean:
            return clean, clean, []
        n = min(rng.choices(N_ERRORS, N_ERRORS_P)[0], max(1, sum(map(_is_word, toks)) // 4))
        types, weights = list(ERROR_WEIGHTS), list(ERROR_WEIGHTS.values())
        applied: list[str] = []
        for _ in range(n * 3):  # a few retries for types with no site in this sentence
            if len(applied) == n:
                break
            kind = rng.choices(types, weights)[0]
            if OPERATIONS[kind](toks, rng):
                applied.append(kind)
        noisy = render(toks, tokenized)
        return noisy, clean, applied if noisy != clean else []


def corrupt(sentence: str, rng: random.Random) -> tuple[str, str, list[str]]:
    """`LearnerErrors().corrupt` with the default error model."""
    return LearnerErrors().corrupt(sentence, rng)


def generate(sentences: list[str], *, seed: int, copies: int = 1, offset: int = 0,
             model: LearnerErrors = LearnerErrors()) -> list[tuple[str, str, list[str]]]:
    """`copies` noisy versions of each sentence, in input order (sentence-major).

    Copy c of sentence i uses `random.Random(f"{seed}:{offset + i}:{c}")`: a slice of a corpus
    generated with `offset` = its first index gives the same rows as the whole corpus does there,
    so the work can be split across processes.
    """
    return [model.corrupt(s, random.Random(f"{seed}:{offset + i}:{c}")) for i, s in enumerate(sentences)
            for c in range(copies)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aggdec.train.learner_errors", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="clean English, one sentence per line")
    p.add_argument("--out", required=True, help="TSV with header source, noisy, clean, errors")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--copies", type=int, default=1)
    p.add_argument("--p-clean", type=float, default=LearnerErrors.p_clean)
    p.add_argument("--p-tokenized", type=float, default=LearnerErrors.p_tokenized)
    p.add_argument("--source", default="learner_errors", help="value of the `source` column")
    a = p.parse_args(argv)
    lines = [s.strip() for s in Path(a.input).read_text(encoding="utf-8").split("\n")]
    bad = next((i for i, s in enumerate(lines) if "\t" in s), None)
    if bad is not None:
        raise SystemExit(f"{a.input}: line {bad + 1} holds a tab")
    lines = [s for s in lines if s]
    rows = generate(lines, seed=a.seed, copies=a.copies, model=LearnerErrors(a.p_clean, a.p_tokenized))
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("source\tnoisy\tclean\terrors\n")
        for noisy, clean, kinds in rows:
            f.write(f"{a.source}\t{noisy}\t{clean}\t{','.join(kinds)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
