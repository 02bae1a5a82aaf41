package evolve

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
)

// Mode is a compatibility mode, named as Confluent Schema Registry names
// them, with what it means for an outbox:
//   - BACKWARD: the new code reads the events stored at the last version
//     (an in-place change must not break them; a new version needs a step
//     from the last);
//   - FORWARD: consumers still on the last version read what the new code
//     publishes (an in-place change must not break them; a new version
//     breaks them: deploy the consumers first);
//   - FULL: both;
//   - the _TRANSITIVE variants hold for every version recorded, not only the
//     last: an outbox keeps events for days, a poison store for longer;
//   - NONE: no check.
type Mode string

// The modes. DefaultMode is BACKWARD_TRANSITIVE.
const (
	Backward           Mode = "BACKWARD"
	BackwardTransitive Mode = "BACKWARD_TRANSITIVE"
	Forward            Mode = "FORWARD"
	ForwardTransitive  Mode = "FORWARD_TRANSITIVE"
	Full               Mode = "FULL"
	FullTransitive     Mode = "FULL_TRANSITIVE"
	None               Mode = "NONE"
	DefaultMode             = BackwardTransitive
)

// Modes are the valid modes.
var Modes = []Mode{Backward, BackwardTransitive, Forward, ForwardTransitive, Full, FullTransitive, None}

func (m Mode) backward() bool {
	return strings.HasPrefix(string(m), "BACKWARD") || strings.HasPrefix(string(m), "FULL")
}
func (m Mode) forward() bool {
	return strings.HasPrefix(string(m), "FORWARD") || strings.HasPrefix(string(m), "FULL")
}
func (m Mode) transitive() bool { return strings.HasSuffix(string(m), "_TRANSITIVE") }

// ParseMode returns the mode named s (case-insensitive).
func ParseMode(s string) (Mode, error) {
	m := Mode(strings.ToUpper(strings.TrimSpace(s)))
	if !slices.Contains(Modes, m) {
		return "", fmt.Errorf("unknown compatibility mode %q (want one of %v)", s, Modes)
	}
	return m, nil
}

// Snapshot records the event types of a build: committed beside the code
// (`ferry schema check --write`), it is what the next change is checked
// against.
type Snapshot struct {
	Types map[string]TypeSnapshot `json:"types"`
}

// TypeSnapshot is one event type in a Snapshot.
type TypeSnapshot struct {
	Current string `json:"current"`
	// Versions are the fields of every version ever recorded: a version
	// whose Go type the code no longer has keeps its last description.
	Versions map[string]Fields `json:"versions"`
	// Reads are the versions the chain read when recorded.
	Reads []string `json:"reads"`
}

// Take returns the snapshot of schemas, keeping from previous (if any) the
// versions the code no longer describes.
func Take(schemas []Schema, previous Snapshot) Snapshot {
	out := Snapshot{Types: map[string]TypeSnapshot{}}
	for name, t := range previous.Types {
		out.Types[name] = TypeSnapshot{Current: t.Current, Versions: maps.Clone(t.Versions), Reads: t.Reads}
	}
	for _, s := range schemas {
		t := out.Types[s.Name()]
		if t.Versions == nil {
			t.Versions = map[string]Fields{}
		}
		maps.Copy(t.Versions, s.Fields())
		t.Current, t.Reads = s.Current(), s.Versions()
		out.Types[s.Name()] = t
	}
	return out
}

// Violation is one incompatibility Check found.
type Violation struct {
	Type    string `json:"type"`
	Version string `json:"version"`
	Field   string `json:"field,omitempty"`
	Rule    string `json:"rule"`
	Detail  string `json:"detail"`
}

func (v Violation) String() string {
	where := fmt.Sprintf("%s version %s", v.Type, v.Version)
	if v.Field != "" {
		where += " field " + v.Field
	}
	return fmt.Sprintf("%s: %s: %s", where, v.Rule, v.Detail)
}

// Check compares the event types of the code (schemas) with previous under
// mode: a change that breaks events already stored (or consumers not yet
// deployed, with FORWARD) is a violation unless a step carries it. An
// event type previous lacks is new and passes.
func Check(previous Snapshot, schemas []Schema, mode Mode) []Violation {
	if mode == None {
		return nil
	}
	var out []Violation
	seen := map[string]bool{}
	for _, s := range schemas {
		name := s.Name()
		seen[name] = true
		p, ok := previous.Types[name]
		if !ok {
			continue
		}
		cur, last := num(s.Current()), num(p.Current)
		if cur < last {
			out = append(out, Violation{Type: name, Version: s.Current(), Rule: "version went back",
				Detail: fmt.Sprintf("the recorded current version is %s: events of it may be stored, and this code refuses them", p.Current)})
			continue
		}
		olds := []string{p.Current}
		if mode.transitive() {
			olds = slices.SortedFunc(maps.Keys(p.Versions), func(a, b string) int { return num(a) - num(b) })
		}
		reads := s.Versions()
		fields := s.Fields()
		for _, old := range olds {
			// Stored events of old must reach the current version.
			if mode.backward() && !slices.Contains(reads, old) {
				out = append(out, Violation{Type: name, Version: old, Rule: "no step",
					Detail: fmt.Sprintf("events of version %s may be stored and no step takes them to version %s: add evolve.Up (or evolve.Raw) from %s", old, s.Current(), old)})
			}
			// A version the code still describes (the current one, a typed
			// step's input) must read what was stored as it.
			if now, ok := fields[old]; ok {
				if was, ok := p.Versions[old]; ok {
					out = append(out, compare(name, old, was, now, mode)...)
				}
			}
		}
		if mode.forward() && cur > last {
			out = append(out, Violation{Type: name, Version: s.Current(), Rule: "consumers behind",
				Detail: fmt.Sprintf("consumers still on version %s refuse version %s events: deploy them first (with a evolve.Down step from %s if producers may be ahead), then publish %s", p.Current, s.Current(), s.Current(), s.Current())})
		}
	}
	if mode.backward() {
		for _, name := range slices.Sorted(maps.Keys(previous.Types)) {
			if !seen[name] {
				out = append(out, Violation{Type: name, Version: previous.Types[name].Current, Rule: "event type removed",
					Detail: "its events may be stored and nothing reads them any more: keep its chain until none is (`ferry status` counts stored events by version)"})
			}
		}
	}
	return out
}

// compare checks one version's fields as recorded (was) against the code's
// (now).
func compare(name, version string, was, now Fields, mode Mode) []Violation {
	var out []Violation
	add := func(field, rule, detail string) {
		out = append(out, Violation{Type: name, Version: version, Field: field, Rule: rule, Detail: detail})
	}
	for _, path := range slices.Sorted(maps.Keys(was)) {
		w := was[path]
		n, ok := now[path]
		switch {
		case !ok && w.Required:
			add(path, "required field removed", "events of this version carry it and this type drops it, and consumers of this version count on it: a rename or a removal is a new version with a step")
		case !ok:
		case w.Type != n.Type && w.Type != "any" && n.Type != "any":
			add(path, "type changed", fmt.Sprintf("from %s to %s: events stored as %s no longer decode; a new version with a step converts them", w.Type, n.Type, w.Type))
		case mode.backward() && !w.Required && n.Required:
			add(path, "optional field made required", "events of this version stored without it no longer satisfy the type")
		case mode.forward() && w.Required && !n.Required:
			add(path, "required field made optional", "consumers of this version count on it, and new events may lack it")
		}
	}
	if mode.backward() {
		for _, path := range slices.Sorted(maps.Keys(now)) {
			if _, ok := was[path]; !ok && now[path].Required {
				add(path, "required field added", "events of this version stored before lack it: make it optional (omitempty or a pointer), or a new version with a step that fills it")
			}
		}
	}
	return out
}

func num(v string) int {
	n, _ := strconv.Atoi(v)
	return n
}
