package console

import (
	"errors"
	"fmt"
	"html/template"
	"net/url"
	"strconv"

	"github.com/ferry-dev/ferry/pipeline/pgfilter"
	"github.com/ferry-dev/ferry/pipeline/pgpoison"
)

// filterFrom reads the poison filter from a query or a form: the keys of
// pgfilter (the command line's --filter words), "q" read as "text" (the
// search box of links made before), and the page's "after".
func filterFrom(v url.Values) (pgpoison.Filter, error) {
	f, err := pgfilter.FromValues(v)
	errs := []error{err}
	if s := v.Get("after"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			errs = append(errs, errors.New("after must be a poison id"))
		}
		f.AfterID = n
	}
	f.Limit = pageSize
	return f, errors.Join(errs...)
}

// filterKeys are the query keys of a filter: the only ones a page passes
// on into its forms and links. Anything else in a crafted link (an action,
// a scope, a confirmation) is dropped, so a click on one button cannot
// carry another's meaning.
var filterKeys = pgfilter.Keys

// filterValues is the filter part of v, one value per key ("q" as "text").
func filterValues(v url.Values) url.Values {
	out := url.Values{}
	for _, k := range filterKeys {
		s := v.Get(k)
		if k == "text" && s == "" {
			s = v.Get("q")
		}
		if s != "" {
			out.Set(k, s)
		}
	}
	return out
}

// filterFields are the filter's hidden inputs, in a fixed order.
func filterFields(v url.Values) [][2]string {
	var out [][2]string
	fv := filterValues(v)
	for _, k := range filterKeys {
		if s := fv.Get(k); s != "" {
			out = append(out, [2]string{k, s})
		}
	}
	return out
}

// nextPage is the query of the page after the one that ended at lastID.
func nextPage(q url.Values, lastID int64) string {
	nq := filterValues(q)
	nq.Set("after", strconv.FormatInt(lastID, 10))
	return nq.Encode()
}

// pageBounds reads a newest-first page's bounds: before (older than an
// id) or after (newer than an id).
func pageBounds(q url.Values) (before, after int64, err error) {
	for name, dst := range map[string]*int64{"before": &before, "after": &after} {
		if v := q.Get(name); v != "" {
			n, perr := strconv.ParseInt(v, 10, 64)
			if perr != nil || n <= 0 {
				return 0, 0, fmt.Errorf("%s must be a poison id", name)
			}
			*dst = n
		}
	}
	if before > 0 && after > 0 {
		return 0, 0, errors.New("give before or after, not both")
	}
	return before, after, nil
}

// pageLink is the href of the older (from the page's last record) or
// newer (from its first) page, with the filter kept; "" when there is
// none. Built whole here: html/template would escape the "=" of a query
// written into an attribute after "?", and the link would lose its page
// and its filter.
func pageLink(path string, q url.Values, exists bool, key string, recs []pgpoison.Record, last bool) template.URL {
	if !exists || len(recs) == 0 {
		return ""
	}
	id := recs[0].ID
	if last {
		id = recs[len(recs)-1].ID
	}
	nq := filterValues(q)
	nq.Set(key, strconv.FormatInt(id, 10))
	return template.URL(path + "?" + nq.Encode())
}

func filterQuery(v url.Values) string { return filterValues(v).Encode() }
