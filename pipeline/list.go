package pipeline

import "strings"

// SplitList reads a comma-separated setting (FERRY_ORDERED_TOPICS, a
// RabbitMQ cluster's URLs, a flag's list): its items trimmed, empty ones
// left out.
func SplitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
