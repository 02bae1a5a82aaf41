package app_test

import (
	"reflect"
	"testing"

	"github.com/ferry-dev/ferry/app"
)

// App is a façade: no part New wired can be swapped from outside (a
// reassigned field silently cut what New wired), only read through its
// methods.
func TestAppExposesNoField(t *testing.T) {
	typ := reflect.TypeFor[app.App]()
	for i := range typ.NumField() {
		if f := typ.Field(i); f.IsExported() {
			t.Errorf("app.App exports field %s: offer a method instead", f.Name)
		}
	}
}
